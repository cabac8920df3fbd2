"""The Qwen-Image-Layered family: its checkpoints read without torch, loaded into `QwenImageLayeredModel`.
The Qwen-Image family's checks and loaders serve it; a request carries one image and comes back as layers.

An empty prompt is captioned by the vision-language model, as diffusers does. Not built (each refused in
one line): memory plans (no memory profile: CUDA loads everything) and Ulysses sequence parallelism.
"""

from dataclasses import replace
from pathlib import Path

from qwen_image_fusion.models.family import CheckpointSpec, FamilyModel, GenerationDefaults
from qwen_image_fusion.models.qwen_image.config import LAYERED_PIPELINE_CLASS, QwenImageConfig
from qwen_image_fusion.models.qwen_image.family import COMPONENT_DIRS, QwenImageFamily


class QwenImageLayeredFamily(QwenImageFamily):
    name = "qwen-image-layered"
    pipeline_classes = (LAYERED_PIPELINE_CLASS,)
    component_dirs = (*COMPONENT_DIRS, "processor")
    presets = ()

    def inspect(self, directory: Path, name: str) -> CheckpointSpec:
        return _layered(super().inspect(directory, name))

    def check_architecture(self, transformer: QwenImageConfig, directory: Path, pipeline_class: str) -> None:
        """Any Qwen-Image transformer: diffusers' Layered pipeline runs with or without the layer flags."""

    def load(self, spec: CheckpointSpec, dtype, device, vae_dtype) -> FamilyModel:
        from qwen_image_fusion.models.qwen_image_layered.model import QwenImageLayeredModel

        return QwenImageLayeredModel.load(spec.directory, dtype, device, vae_dtype)

    def memory_profile(self, spec: CheckpointSpec, dtype_bytes: int, vae_dtype_bytes: int):
        """None: memory plans are not built for Layered yet (everything loads onto the device)."""
        return None

    def spec_for(self, model: FamilyModel, name: str, defaults: GenerationDefaults) -> CheckpointSpec:
        return _layered(super().spec_for(model, name, defaults))


def _layered(spec: CheckpointSpec) -> CheckpointSpec:
    return replace(
        spec,
        max_images=1,
        images_required=True,
        starts_from_image=False,
        decomposes=True,
        captions=True,
        sequence_parallel=False,
        shares_text_encoding=False,  # its prompt may be its caption of the image
    )


FAMILY = QwenImageLayeredFamily()
