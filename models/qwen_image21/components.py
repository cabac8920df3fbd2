"""The components of a Qwen-Image 2.1 checkpoint and its diffusers directory layout (checkpoint.py here):
Qwen3-VL text encoder and processor (transformers), our transformer, `AutoencoderKLQwenImage21` and the
flow-matching scheduler (diffusers)."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from qwen_image_fusion.models.family import DEFAULTS_KEY, GenerationDefaults
from qwen_image_fusion.models.loading import (
    load_diffusers_model,
    load_pretrained_model,
    load_scheduler,
    load_transformer,
    quiet_loading,
    save_transformer,
)
from qwen_image_fusion.models.qwen_image21.checkpoint import PIPELINE_CLASS
from qwen_image_fusion.models.qwen_image21.config import CLASS_NAME
from qwen_image_fusion.models.qwen_image21.loading import build_transformer21
from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer
from qwen_image_fusion.models.vl_processor import load_vl_processor

CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass
class Components21:
    """Everything a 2.1 request runs, and the Turbo checkpoint's sampling grid (`sample_sigmas`)."""

    processor: Qwen3VLProcessor
    text_encoder: Qwen3VLForConditionalGeneration
    transformer: QwenImage21Transformer
    vae: AutoencoderKLQwenImage21
    scheduler: FlowMatchEulerDiscreteScheduler
    sample_sigmas: tuple[float, ...] | None = None

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer


def load_components21(
    directory: Path,
    dtype: torch.dtype,
    device: torch.device,
    vae_dtype: torch.dtype,
    sample_sigmas: tuple[float, ...] | None,
    processor_backend: str = "auto",
) -> Components21:
    """Every component of a checkpoint whose configs `read_configs21` has checked, each tensor validated by
    name and shape; the processor with torchvision's image backend where it is installed, else PIL's."""
    with quiet_loading():
        return Components21(
            processor=load_vl_processor(directory / "processor", Qwen3VLProcessor, processor_backend),
            text_encoder=load_pretrained_model(
                directory / "text_encoder", Qwen3VLForConditionalGeneration, dtype, device, "text encoder"
            ),
            transformer=load_transformer(directory / "transformer", build_transformer21, dtype, device),
            vae=load_diffusers_model(directory / "vae", AutoencoderKLQwenImage21, vae_dtype, device),
            scheduler=load_scheduler(directory / "scheduler"),
            sample_sigmas=sample_sigmas,
        )


def save_processor(processor: Qwen3VLProcessor, directory: Path) -> None:
    """The processor's image processor, tokenizer and chat template (its own `save_pretrained` needs the
    video processor, which needs torchvision)."""
    processor.image_processor.save_pretrained(directory)
    processor.tokenizer.save_pretrained(directory)
    if processor.chat_template is not None:
        (directory / CHAT_TEMPLATE_FILE).write_text(processor.chat_template)


def save_components21(
    components: Components21,
    directory: Path,
    skip: tuple[str, ...] = (),
    defaults: GenerationDefaults | None = None,
) -> None:
    """A diffusers-layout directory that `load_components21` and diffusers' `QwenImage21Pipeline` read, with
    `defaults` as the checkpoint's own generation defaults; components in `skip` are the caller's to write."""
    directory.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {
        "_class_name": PIPELINE_CLASS,
        "processor": ["transformers", "Qwen3VLProcessor"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "transformer": ["diffusers", CLASS_NAME],
        "vae": ["diffusers", "AutoencoderKLQwenImage21"],
    }
    if components.sample_sigmas is not None:
        index["sample_sigmas"] = list(components.sample_sigmas)
    if defaults is not None:
        index[DEFAULTS_KEY] = defaults.as_metadata()
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))
    writers = {
        "processor": lambda path: save_processor(components.processor, path),
        "text_encoder": lambda path: components.text_encoder.save_pretrained(path),
        "transformer": lambda path: save_transformer(components.transformer, path),
        "vae": lambda path: components.vae.save_pretrained(path),
        "scheduler": lambda path: components.scheduler.save_pretrained(path),
    }
    for name, write in writers.items():
        if name not in skip:
            write(directory / name)
