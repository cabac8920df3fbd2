"""The five components of a Qwen-Image checkpoint and their diffusers directory layout (DESIGN §2)."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

from models.errors import CheckpointError
from models.loading import load_transformer, read_json, save_transformer
from models.text_encoder import load_text_encoder
from models.tokenizer import load_tokenizer
from models.transformer import QwenImageTransformer

SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
COMPONENT_DIRS = ("transformer", "text_encoder", "tokenizer", "vae", "scheduler")


@dataclass
class Components:
    """Everything the pipeline runs: tokenizer, text encoder, DiT, VAE and scheduler."""

    tokenizer: Any
    text_encoder: torch.nn.Module
    transformer: QwenImageTransformer
    vae: AutoencoderKLQwenImage
    scheduler: FlowMatchEulerDiscreteScheduler


def default_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The flow-matching Euler scheduler with Qwen-Image's dynamic shift settings."""
    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def check_layout(directory: Path) -> None:
    """Refuse a path that is not a complete diffusers-layout Qwen-Image directory, naming what lacks."""
    if not directory.is_dir():
        raise CheckpointError(f"model directory {directory} does not exist")
    read_json(directory / "model_index.json")
    missing = [name for name in COMPONENT_DIRS if not (directory / name).is_dir()]
    if missing:
        raise CheckpointError(f"{directory} is incomplete: missing {', '.join(missing)}/")


def load_vae(directory: Path, dtype: torch.dtype, device: torch.device) -> AutoencoderKLQwenImage:
    """diffusers' Qwen-Image VAE from a local `vae/` directory."""
    read_json(directory / "config.json")
    try:
        vae = AutoencoderKLQwenImage.from_pretrained(directory, torch_dtype=dtype, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"cannot load VAE from {directory}: {err}") from err
    return vae.to(device).eval().requires_grad_(False)


def load_scheduler(directory: Path) -> FlowMatchEulerDiscreteScheduler:
    """The scheduler of `scheduler/scheduler_config.json`."""
    read_json(directory / "scheduler_config.json")
    try:
        return FlowMatchEulerDiscreteScheduler.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"cannot load scheduler from {directory}: {err}") from err


def load_components(directory: Path, dtype: torch.dtype, device: torch.device) -> Components:
    """Load a diffusers-layout checkpoint directory, validating every component."""
    check_layout(directory)
    return Components(
        tokenizer=load_tokenizer(directory / "tokenizer"),
        text_encoder=load_text_encoder(directory / "text_encoder", dtype, device),
        transformer=load_transformer(directory / "transformer", dtype, device),
        vae=load_vae(directory / "vae", dtype, device),
        scheduler=load_scheduler(directory / "scheduler"),
    )


def save_components(components: Components, directory: Path, skip: tuple[str, ...] = ()) -> None:
    """Write a diffusers-layout directory that `load_components` (and diffusers) can read.

    Components named in `skip` are left for the caller to write (quantize writes its own transformer).
    """
    directory.mkdir(parents=True, exist_ok=True)
    index = {
        "_class_name": "QwenImagePipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))
    writers = {
        "tokenizer": lambda path: components.tokenizer.save_pretrained(path),
        "text_encoder": lambda path: components.text_encoder.save_pretrained(path),
        "transformer": lambda path: save_transformer(components.transformer, path),
        "vae": lambda path: components.vae.save_pretrained(path),
        "scheduler": lambda path: components.scheduler.save_pretrained(path),
    }
    for name, write in writers.items():
        if name not in skip:
            write(directory / name)
