"""The Edit family's memory profile (torch-free): Qwen-Image's components (the vision tower sits in the text
encoder's fixed part) and its activations, plus what the input images add to each phase.

Each input image adds to the text-encoder call its vision tower's patches (measured by
`bench/activation_memory.py` with real tensors: 34.5 x vision width bytes per patch, rounded up to 40) and
its vision tokens to the language model's sequence, and to every transformer call its VAE tokens and its
vision tokens (the prompt embeddings carry them); the VAE encodes each input image before denoising
(measured 20.2 x base_dim bytes per pixel, rounded up to 23; Edit's one image once per prompt, in one batch,
as diffusers encodes a prompt batch's images), whole even when the plan decodes in tiles,
which the decode phase's bound covers. Image sizes are the pipelines' fixed areas with 10% to spare for
the rounding of their sides.
"""

import math
from dataclasses import dataclass
from pathlib import Path

from qwen_image_fusion.models.checkpoint import read_json
from qwen_image_fusion.models.memory import MemoryProfile, Workload
from qwen_image_fusion.models.qwen_image.memory import (
    ENCODE_BYTES_PER_BASE,
    QwenImageActivations,
    activation_fields,
    component_parts,
)
from qwen_image_fusion.models.qwen_image_edit.config import CONDITION_AREA, VAE_AREA, EditKind

VISION_BYTES_PER_WIDTH = 40  # per patch: measured 34.5
AREA_SLACK = 1.1  # sides rounded to multiples of 32 give a little more than the nominal area


@dataclass(frozen=True)
class EditActivations(QwenImageActivations):
    """Qwen-Image's activations, with `Workload.input_images` input images of the Edit kind's sizes."""

    vision_width: int = 1280
    vision_patch: int = 14
    vision_merge: int = 2
    vision_area: int = CONDITION_AREA  # pixels the vision tower sees per input image

    def vision_patches(self) -> int:
        return math.ceil(self.vision_area * AREA_SLACK / self.vision_patch**2)

    def vision_tokens(self) -> int:
        return math.ceil(self.vision_patches() / self.vision_merge**2)

    def input_tokens(self) -> int:
        """Transformer tokens of one input image's latents."""
        return math.ceil(VAE_AREA * AREA_SLACK / (2 * self.vae_scale) ** 2)

    def encode(self, workload: Workload) -> int:
        vision = workload.input_images * self.vision_patches() * VISION_BYTES_PER_WIDTH * self.vision_width
        tokens = workload.prompts * workload.input_images * self.vision_tokens()
        return super().encode(workload) + self.text_bytes(tokens) + round(vision * self.dtype_bytes / 2)

    def stream_tokens(self, workload: Workload) -> tuple[int, int]:
        """The input images' latents join the image stream, their vision tokens the text stream."""
        image, text = super().stream_tokens(workload)
        inputs = workload.input_images
        return image + inputs * self.input_tokens(), text + inputs * self.vision_tokens()

    def decode(self, workload: Workload, tiled: bool) -> int:
        """Decoding the outputs, or encoding an input image, always whole (the larger); Edit encodes its
        image once per prompt in one batch (Plus takes one prompt)."""
        if not workload.input_images:
            return super().decode(workload, tiled)
        per_input = ENCODE_BYTES_PER_BASE * self.vae_base * VAE_AREA * AREA_SLACK * workload.prompts
        return max(super().decode(workload, tiled), round(per_input * self.dtype_bytes / 2))


def memory_profile(directory: Path, kind: EditKind, dtype_bytes: int, vae_dtype_bytes: int) -> MemoryProfile:
    """The profile of an Edit checkpoint whose configs `inspect` has checked (`kind`: Edit or Plus)."""
    vision = read_json(directory / "text_encoder" / "config.json")["vision_config"]
    activations = EditActivations(
        **activation_fields(directory, dtype_bytes),
        vision_width=vision.get("hidden_size", 1280),
        vision_patch=vision.get("patch_size", 14),
        vision_merge=vision.get("spatial_merge_size", 2),
        vision_area=CONDITION_AREA if kind.plus else VAE_AREA,
    )
    return MemoryProfile(component_parts(directory, dtype_bytes, vae_dtype_bytes), activations)
