"""A checkpoint's image geometry read from its VAE config, without torch: the CLI checks sizes with it
before any model loads."""

import json
from pathlib import Path
from typing import Any

from models.errors import CheckpointError

DEFAULT_VAE_DOWNSAMPLE = (False, True, True)  # AutoencoderKLQwenImage's default temperal_downsample
DEFAULT_VAE_Z_DIM = 16


def vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """Pixels per latent cell along a side: `2 ** len(temperal_downsample)`, as diffusers reads it."""
    return 2 ** len(vae_config.get("temperal_downsample", DEFAULT_VAE_DOWNSAMPLE))


def check_model_dir(model_dir: Path) -> None:
    """CheckpointError unless `model_dir` is an existing directory."""
    if not model_dir.exists():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise CheckpointError(f"model path {model_dir} is a file, not a directory")


def size_multiple(model_dir: Path) -> int:
    """Width and height of `model_dir`'s images must be multiples of this: the VAE scale times 2x2 packing."""
    check_model_dir(model_dir)
    path = model_dir / "vae" / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"missing {path}") from err
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return 2 * vae_scale_factor(config)
