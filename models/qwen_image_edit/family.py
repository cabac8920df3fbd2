"""The Qwen-Image-Edit family (Edit, Edit-2509, Edit-2511): its checkpoints read without torch, loaded into
`QwenImageEditModel`. The Qwen-Image family's checks and loaders serve it; this adds the processor, the
vision tower, how many images a request takes, and whether it inpaints (Edit: `QwenImageEditInpaintPipeline`).

An Edit checkpoint always needs an input image: diffusers' Edit pipelines fail on `image=None` (they read
its size for the default output), so a request without one is refused in one line before anything runs.
"""

from dataclasses import replace
from pathlib import Path

from qwen_image_fusion.models.checkpoint import read_model_index
from qwen_image_fusion.models.family import CheckpointSpec, FamilyModel, GenerationDefaults
from qwen_image_fusion.models.qwen_image.family import COMPONENT_DIRS, QwenImageFamily
from qwen_image_fusion.models.qwen_image_edit.config import EDIT_KINDS, EditKind, check_processor_fits
from qwen_image_fusion.models.qwen_image_edit.presets import EDIT_LIGHTNING_PRESETS


class QwenImageEditFamily(QwenImageFamily):
    name = "qwen-image-edit"
    pipeline_classes = tuple(EDIT_KINDS)
    component_dirs = (*COMPONENT_DIRS, "processor")
    presets = EDIT_LIGHTNING_PRESETS

    def inspect(self, directory: Path, name: str) -> CheckpointSpec:
        spec = super().inspect(directory, name)
        check_processor_fits(directory)
        kind = EDIT_KINDS[read_model_index(directory)["_class_name"]]
        return edit_spec(spec, kind)

    def load(self, spec: CheckpointSpec, dtype, device, vae_dtype) -> FamilyModel:
        from qwen_image_fusion.models.qwen_image_edit.model import QwenImageEditModel

        return QwenImageEditModel.load(spec.directory, dtype, device, vae_dtype)

    def memory_profile(self, spec: CheckpointSpec, dtype_bytes: int, vae_dtype_bytes: int):
        from qwen_image_fusion.models.qwen_image_edit.memory import memory_profile

        kind = EDIT_KINDS[read_model_index(spec.directory)["_class_name"]]
        return memory_profile(spec.directory, kind, dtype_bytes, vae_dtype_bytes)

    def spec_for(self, model: FamilyModel, name: str, defaults: GenerationDefaults) -> CheckpointSpec:
        return edit_spec(super().spec_for(model, name, defaults), model.kind)


def edit_spec(spec: CheckpointSpec, kind: EditKind) -> CheckpointSpec:
    """Qwen-Image's spec as an Edit checkpoint of `kind` has it: input images required, no start image of its
    own; Edit (not Plus: diffusers has no Plus inpainting) inpaints its one input image."""
    return replace(
        spec,
        max_images=kind.max_images,
        images_required=True,
        starts_from_image=False,
        inpaints_input=not kind.plus,
        shares_text_encoding=False,  # its prompts see its input images
    )


FAMILY = QwenImageEditFamily()
