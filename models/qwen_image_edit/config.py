"""The Edit family's configs, torch-free: which diffusers pipeline a checkpoint names (Edit or Plus), how many
input images it takes, the output size its images suggest, and the checks that its processor and vision
tower fit the rest before any weight is read."""

from dataclasses import dataclass
from pathlib import Path

from qwen_image_fusion.models.checkpoint import read_json
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.family import calculate_dimensions

VAE_AREA = 1024 * 1024  # the pixels the VAE sees per input image, and the default output area
CONDITION_AREA = 384 * 384  # Plus: the pixels the vision tower sees per input image
# Qwen-Image-Edit-2509's model card: "Optimal performance is currently achieved with 1 to 3 input images"
# (diffusers' QwenImageEditPlusPipeline itself sets no limit); Edit takes one image.
PLUS_MAX_IMAGES = 3


@dataclass(frozen=True)
class EditKind:
    """What differs between the two Edit pipelines of diffusers (chosen by model_index.json's class name)."""

    pipeline_class: str
    plus: bool  # several images, "Picture N:" labels, 384x384-area vision images; one prompt per call
    max_images: int

    def default_image(self, sizes: list[tuple[int, int]]) -> tuple[int, int]:
        """The (width, height) of the input image whose aspect the output takes: the first (Edit) or the
        last (Plus), as diffusers' pipelines pick it."""
        return sizes[-1] if self.plus else sizes[0]


EDIT_KINDS = {
    kind.pipeline_class: kind
    for kind in (
        EditKind("QwenImageEditPipeline", plus=False, max_images=1),
        EditKind("QwenImageEditPlusPipeline", plus=True, max_images=PLUS_MAX_IMAGES),
    )
}


def default_output_size(kind: EditKind, sizes: list[tuple[int, int]], multiple: int) -> tuple[int, int]:
    """The output (width, height) of a request without one: the `VAE_AREA`-sized box at the aspect of the
    image `kind` picks, floored to `multiple` (diffusers' pipelines)."""
    width, height = kind.default_image(sizes)
    width, height = calculate_dimensions(VAE_AREA, width / height)
    return width // multiple * multiple, height // multiple * multiple


VISION_KEYS = ("patch_size", "temporal_patch_size", "merge_size")


def check_processor_fits(directory: Path) -> None:
    """Refuse, before weights are read, a text encoder without a vision tower, or a `processor/` whose
    patching differs from the vision tower's (patch size, temporal patch size, merge size), naming both
    values."""
    processor = read_json(directory / "processor" / "preprocessor_config.json")
    vision = read_json(directory / "text_encoder" / "config.json").get("vision_config")
    if not isinstance(vision, dict):
        raise CheckpointError(
            f"{directory}: the text encoder's config has no vision_config: an Edit checkpoint needs "
            "Qwen2.5-VL's vision tower to see its input images"
        )
    vision_names = {"merge_size": "spatial_merge_size"}
    for key in VISION_KEYS:
        theirs = vision.get(vision_names.get(key, key))
        if processor.get(key) is not None and theirs is not None and processor[key] != theirs:
            raise CheckpointError(
                f"{directory}: processor {key} {processor[key]} differs from the text encoder's vision "
                f"{vision_names.get(key, key)} {theirs}"
            )
