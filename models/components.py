"""The five components of a Qwen-Image checkpoint and their diffusers directory layout (DESIGN §2)."""

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
from diffusers.utils import logging as diffusers_logging
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from models.config import QwenImageConfig
from models.errors import CheckpointError
from models.geometry import DEFAULT_VAE_Z_DIM, check_model_dir, vae_scale_factor
from models.loading import check_state_dict, load_transformer, read_json, read_state_dict, save_transformer
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

    def __post_init__(self) -> None:
        check_compatible(
            self.transformer.config, dict(self.vae.config), self.text_encoder.config.text_config.hidden_size
        )

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell along each side: 2 per VAE downsampling stage (diffusers' rule)."""
        return vae_scale_factor(dict(self.vae.config))

    @property
    def latent_channels(self) -> int:
        """Latent channels before 2x2 packing: the transformer's `in_channels // 4`, as diffusers does."""
        return self.transformer.config.in_channels // 4


def check_compatible(transformer: QwenImageConfig, vae: dict[str, Any], text_hidden: int) -> None:
    """Refuse components that cannot run together, naming both disagreeing values."""
    z_dim = vae.get("z_dim", DEFAULT_VAE_Z_DIM)
    problems = []
    if transformer.patch_size != 2:
        problems.append(f"transformer patch_size is {transformer.patch_size}, the pipeline packs latents 2x2")
    if transformer.in_channels != 4 * z_dim:
        problems.append(
            f"transformer in_channels {transformer.in_channels} needs a VAE z_dim of "
            f"{transformer.in_channels / 4:g} (2x2 packed), but the VAE's z_dim is {z_dim}"
        )
    if transformer.out_channels != z_dim:
        problems.append(
            f"transformer out_channels {transformer.out_channels} differs from the VAE's z_dim {z_dim}"
        )
    for key in ("latents_mean", "latents_std"):
        values = vae.get(key)
        if values is None or len(values) != z_dim:
            problems.append(f"VAE {key} has {0 if values is None else len(values)} values for z_dim {z_dim}")
    if transformer.joint_attention_dim != text_hidden:
        problems.append(
            f"transformer joint_attention_dim {transformer.joint_attention_dim} differs from the text "
            f"encoder's hidden_size {text_hidden}"
        )
    if problems:
        raise CheckpointError(f"components do not fit together: {problems[0]}")


def default_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The flow-matching Euler scheduler with Qwen-Image's dynamic shift settings."""
    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def check_layout(directory: Path, components: tuple[str, ...] = COMPONENT_DIRS) -> dict[str, Any]:
    """Refuse a path that is not a complete diffusers-layout Qwen-Image directory (the folders of
    `components`), naming what lacks; returns its model_index.json."""
    check_model_dir(directory)
    index = read_json(directory / "model_index.json")
    missing = [name for name in components if not (directory / name).is_dir()]
    if missing:
        raise CheckpointError(f"{directory} is incomplete: missing {', '.join(missing)}/")
    return index


def check_configs(directory: Path) -> None:
    """Compare the component configs before any weight is read, so a misfit fails in a second."""
    transformer = QwenImageConfig.from_dict(read_json(directory / "transformer" / "config.json"))
    vae = read_json(directory / "vae" / "config.json")
    text = read_json(directory / "text_encoder" / "config.json")
    hidden = text.get("text_config", {}).get("hidden_size", text.get("hidden_size"))
    if not isinstance(hidden, int):
        raise CheckpointError(f"{directory / 'text_encoder' / 'config.json'} has no hidden_size")
    try:
        check_compatible(transformer, vae, hidden)
    except CheckpointError as err:
        raise CheckpointError(f"{directory}: {err}") from err


@contextmanager
def quiet_loading() -> Iterator[None]:
    """Silence library progress bars, info logs and warnings while loading, so that a load error is the
    one line the user sees (our own checks report every real problem)."""
    bars = transformers_logging.is_progress_bar_enabled()
    levels = transformers_logging.get_verbosity(), diffusers_logging.get_verbosity()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers_logging.set_verbosity(levels[0])
        diffusers_logging.set_verbosity(levels[1])
        if bars:
            transformers_logging.enable_progress_bar()


def load_vae(directory: Path, dtype: torch.dtype, device: torch.device) -> AutoencoderKLQwenImage:
    """diffusers' Qwen-Image VAE from a local `vae/` directory, every tensor checked by name and shape."""
    config_path = directory / "config.json"
    config = read_json(config_path)
    try:
        with torch.device("meta"):
            vae = AutoencoderKLQwenImage.from_config(config)
    except (TypeError, ValueError, IndexError, RuntimeError) as err:
        raise CheckpointError(f"{config_path}: not a valid AutoencoderKLQwenImage config: {err}") from err
    origins: dict[str, Path] = {}
    state = read_state_dict(directory, device, origins)
    check_state_dict(vae.state_dict(), state, directory, origins)
    vae.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return vae.eval().requires_grad_(False)


def load_scheduler(directory: Path) -> FlowMatchEulerDiscreteScheduler:
    """The scheduler of `scheduler/scheduler_config.json`."""
    read_json(directory / "scheduler_config.json")
    try:
        return FlowMatchEulerDiscreteScheduler.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"cannot load scheduler from {directory}: {err}") from err


def load_components(
    directory: Path,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Components:
    """Load a diffusers-layout checkpoint directory, validating every component (configs first);
    `tokenizer` given stands in for a `tokenizer/` folder the directory then need not have."""
    needed = COMPONENT_DIRS if tokenizer is None else tuple(c for c in COMPONENT_DIRS if c != "tokenizer")
    index = check_layout(directory, needed)
    check_configs(directory)
    with quiet_loading():
        if tokenizer is None:
            tokenizer = load_tokenizer(directory / "tokenizer", index.get("tokenizer"))
        return Components(
            tokenizer=tokenizer,
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
        "tokenizer": ["transformers", type(components.tokenizer).__name__],
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
