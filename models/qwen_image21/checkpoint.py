"""A Qwen-Image 2.1 checkpoint's configs, read and checked without torch (diffusers 0.42's
`QwenImage21Pipeline`).

Layout: `model_index.json` (`_class_name` QwenImage21Pipeline; the Turbo checkpoint adds `sample_sigmas`, its
few-step sampling grid), `transformer/` (`QwenImage21Transformer2DModel`), `text_encoder/` (Qwen3-VL),
`processor/` (Qwen3-VL's image processor, tokenizer and chat template), `vae/` (`AutoencoderKLQwenImage21`),
`scheduler/`. Everything that decides whether the components fit together is refused here in one line.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen_image_fusion.models.checkpoint import (
    check_layout,
    check_vision_processor,
    read_json,
    read_model_index,
)
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.family import DEFAULTS_KEY, GenerationDefaults
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config

PIPELINE_CLASS = "QwenImage21Pipeline"
COMPONENT_DIRS = ("transformer", "text_encoder", "processor", "vae", "scheduler")
VAE_SCALE = 16  # diffusers' pipeline fixes it: one unpatched latent token per 16x16 pixels
SLOT_TOKENS = 4  # each vision-language image slot stands for 2x2 latent tokens
SIZE_MULTIPLE = 2 * VAE_SCALE  # diffusers floors sizes to this (its latents are 2 * (side // 32))
OUTPUT_RESOLUTION = 1024  # diffusers' `output_resolution`: default side, and the condition images' area
DEFAULT_STEPS = 40
DEFAULT_TRUE_CFG_SCALE = 1.0  # 2.1 samples without guidance (diffusers' default)
# diffusers takes any number of condition images; each 1024x1024 one adds 4096 image tokens and 1024
# vision-language tokens to every step's prefix, so we stop at four (a sequence five times text-to-image's).
MAX_CONDITION_IMAGES = 4
VAE_CHANNELS = 4  # the pipeline hands the VAE RGBA pixels
VAE_DEFAULTS = {"z_dim": 64, "temperal_downsample": [False, True, True, True], "in_channels": VAE_CHANNELS}
TEXT_ENCODER_TYPE = "qwen3_vl"
KV_CACHE_ENV = "QWEN_IMAGE_KV_CACHE"  # 0 turns the prefix KV cache off (diffusers' `use_kv_cache`)
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class Configs21:
    """What loading and the spec need from a 2.1 checkpoint's configs."""

    transformer: QwenImage21Config
    z_dim: int
    sample_sigmas: tuple[float, ...] | None
    defaults: GenerationDefaults


def read_configs21(directory: Path) -> Configs21:
    """Read and cross-check a 2.1 checkpoint's configs before any weight is read (CheckpointError names the
    file and both disagreeing values)."""
    index = read_model_index(directory)
    check_layout(directory, COMPONENT_DIRS)
    transformer_path = directory / "transformer" / "config.json"
    try:
        transformer = QwenImage21Config.from_dict(read_json(transformer_path))
    except CheckpointError as err:
        raise CheckpointError(f"{transformer_path}: {err}") from err
    if transformer.patch_size != 1:
        raise CheckpointError(
            f"{transformer_path}: patch_size {transformer.patch_size}, but the 2.1 pipeline packs latents "
            "unpatched (patch_size 1)"
        )
    z_dim = _check_vae(directory / "vae" / "config.json", transformer)
    _check_text_encoder(directory, transformer)
    read_json(directory / "scheduler" / "scheduler_config.json")
    sigmas = _sample_sigmas(index.get("sample_sigmas"), directory / "model_index.json")
    steps = DEFAULT_STEPS if sigmas is None else len(sigmas)
    defaults = GenerationDefaults(
        width=OUTPUT_RESOLUTION,
        height=OUTPUT_RESOLUTION,
        num_inference_steps=steps,
        true_cfg_scale=DEFAULT_TRUE_CFG_SCALE,
    ).with_metadata(index.get(DEFAULTS_KEY), directory / "model_index.json")
    if defaults.width % SIZE_MULTIPLE or defaults.height % SIZE_MULTIPLE:
        raise CheckpointError(
            f"{directory / 'model_index.json'}: default size {defaults.width}x{defaults.height} is not a "
            f"multiple of {SIZE_MULTIPLE}"
        )
    return Configs21(transformer, z_dim, sigmas, defaults)


def _check_vae(path: Path, transformer: QwenImage21Config) -> int:
    """The VAE's z_dim, after checking it is the 16x, RGBA-input VAE whose latents the transformer reads."""
    vae: dict[str, Any] = VAE_DEFAULTS | read_json(path)
    z_dim, stages = vae["z_dim"], vae["temperal_downsample"]
    if not isinstance(stages, list) or 2 ** len(stages) != VAE_SCALE:
        raise CheckpointError(f"{path}: temperal_downsample {stages} is not a {VAE_SCALE}x VAE (4 stages)")
    if vae["in_channels"] != VAE_CHANNELS:
        raise CheckpointError(
            f"{path}: in_channels {vae['in_channels']}, but the 2.1 pipeline encodes RGBA images (4)"
        )
    for key in ("latents_mean", "latents_std"):
        if key in vae and (not isinstance(vae[key], list) or len(vae[key]) != z_dim):
            raise CheckpointError(f"{path}: {key} must be a list of z_dim = {z_dim} numbers")
    for name in ("in_channels", "out_channels"):
        channels = getattr(transformer, name)
        if channels != z_dim:
            raise CheckpointError(
                f"{path}: the VAE's z_dim {z_dim} differs from the transformer's {name} {channels}"
            )
    return z_dim


def _check_text_encoder(directory: Path, transformer: QwenImage21Config) -> None:
    """A Qwen3-VL whose hidden size the transformer's text input takes, and a processor that fits it."""
    path = directory / "text_encoder" / "config.json"
    config = read_json(path)
    if config.get("model_type") != TEXT_ENCODER_TYPE:
        raise CheckpointError(
            f"{path}: model_type {config.get('model_type')!r}, but 2.1 encodes with {TEXT_ENCODER_TYPE!r}"
        )
    hidden = config.get("text_config", {}).get("hidden_size")
    if hidden != transformer.context_in_dim:
        raise CheckpointError(
            f"{path}: hidden_size {hidden} differs from the transformer's context_in_dim "
            f"{transformer.context_in_dim}"
        )
    processor = directory / "processor"
    check_vision_processor(processor, directory / "text_encoder")
    if not any((processor / name).is_file() for name in CHAT_TEMPLATE_FILES):
        raise CheckpointError(
            f"{processor} has no chat template: the pipeline counts the system prompt's tokens with it"
        )


def _sample_sigmas(value: object, where: Path) -> tuple[float, ...] | None:
    """The Turbo checkpoint's sampling grid (`sample_sigmas`, before the scheduler's shift), checked."""
    if value is None:
        return None
    numbers = isinstance(value, list) and value and all(_is_number(s) for s in value)
    if not numbers or not all(0 < s <= 1 for s in value):
        raise CheckpointError(f"{where}: sample_sigmas must be a non-empty list of numbers in (0, 1]")
    return tuple(float(s) for s in value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
