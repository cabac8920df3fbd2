"""The components of a Qwen-Image-Layered checkpoint: Qwen-Image's five plus the Qwen2-VL processor that
diffusers' pipeline lists (it captions an empty prompt with it), in diffusers' directory layout."""

from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qwen_image_fusion.models.loading import quiet_loading
from qwen_image_fusion.models.qwen_image.components import Components, load_components
from qwen_image_fusion.models.qwen_image.config import LAYERED_PIPELINE_CLASS
from qwen_image_fusion.models.qwen_image_edit.components import PROCESSOR_CLASS, write_processor
from qwen_image_fusion.models.qwen_image_edit.conditioning import load_processor


@dataclass
class LayeredComponents(Components):
    """Qwen-Image's components and the processor, kept so a checkpoint written back (quantize) is one
    diffusers loads."""

    processor: Any

    def model_index(self) -> dict[str, Any]:
        index = super().model_index() | {"_class_name": LAYERED_PIPELINE_CLASS}
        return index | {"processor": ["transformers", PROCESSOR_CLASS]}

    def writers(self):
        return super().writers() | {"processor": partial(write_processor, self.processor)}


def load_layered_components(
    directory: Path, dtype: torch.dtype, device: torch.device, vae_dtype: torch.dtype | None = None
) -> LayeredComponents:
    """Every component of a Layered checkpoint whose configs `inspect` has checked."""
    base = load_components(directory, dtype, device, vae_dtype)
    with quiet_loading():
        processor = load_processor(directory / "processor")
    shared = {f.name: getattr(base, f.name) for f in fields(Components)}
    return LayeredComponents(**shared, processor=processor)
