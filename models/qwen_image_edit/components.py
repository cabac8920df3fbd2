"""The components of a Qwen-Image-Edit checkpoint: Qwen-Image's five plus the Qwen2-VL processor that turns
input images into the vision tower's patches, in diffusers' directory layout (`processor/`)."""

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qwen_image_fusion.models.checkpoint import read_json
from qwen_image_fusion.models.loading import quiet_loading
from qwen_image_fusion.models.qwen_image.components import Components, load_components
from qwen_image_fusion.models.qwen_image_edit.conditioning import load_processor
from qwen_image_fusion.models.qwen_image_edit.config import EDIT_KINDS, EditKind

PROCESSOR_CLASS = "Qwen2VLProcessor"  # what diffusers' Edit checkpoints name in model_index.json


@dataclass
class EditComponents(Components):
    """Qwen-Image's components, the processor (image backend: torchvision where installed, else PIL) and
    the kind of Edit pipeline the checkpoint names."""

    processor: Any
    kind: EditKind

    def model_index(self) -> dict[str, Any]:
        index = super().model_index() | {"_class_name": self.kind.pipeline_class}
        return index | {"processor": ["transformers", PROCESSOR_CLASS]}

    def writers(self) -> dict[str, Callable[[Path], None]]:
        """Qwen-Image's writers and the processor's folder."""
        return super().writers() | {"processor": partial(write_processor, self.processor)}


def write_processor(processor: Any, path: Path) -> None:
    """A Qwen2-VL processor's folder: its image processor config and tokenizer (the processor's own
    `save_pretrained` needs a video processor, which needs torchvision)."""
    processor.image_processor.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)


def load_edit_components(
    directory: Path, dtype: torch.dtype, device: torch.device, vae_dtype: torch.dtype | None = None
) -> EditComponents:
    """Every component of an Edit checkpoint whose configs `inspect` has checked (loaders of Qwen-Image,
    then the processor)."""
    base = load_components(directory, dtype, device, vae_dtype)
    kind = EDIT_KINDS[read_json(directory / "model_index.json")["_class_name"]]
    with quiet_loading():
        processor = load_processor(directory / "processor")
    shared = {f.name: getattr(base, f.name) for f in fields(Components)}
    return EditComponents(**shared, processor=processor, kind=kind)
