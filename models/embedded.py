"""The embedded default model: real Qwen-Image architecture, tiny sizes, deterministic random weights.

Built in-process in about a second, with no download, so every command and test runs anywhere.
Its images are noise: it exists to exercise the whole application, not to draw.
"""

import math

import torch
from diffusers import AutoencoderKLQwenImage

from models.components import Components, default_scheduler
from models.config import QwenImageConfig
from models.text_encoder import build_tiny_text_encoder
from models.tokenizer import build_qwen2_tokenizer
from models.transformer import QwenImageTransformer

EMBEDDED_NAME = "embedded-default"
EMBEDDED_SEED = 20250804
TEXT_HIDDEN = 64
EMBEDDED_TRANSFORMER = QwenImageConfig(
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=TEXT_HIDDEN,
    axes_dims_rope=(8, 12, 12),
)
EMBEDDED_VAE = {"base_dim": 16, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1}


def fill_deterministic(module: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from a seeded generator: fan-in scaled weights, small biases, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            parent = name.rsplit(".", 2)[-2] if "." in name else ""
            if "norm" in parent or name.endswith("gamma"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif param.ndim == 1:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
            else:
                fan_in = math.prod(param.shape[1:])
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Move to `device` and cast parameters only: fp32 buffers (RoPE inverse frequencies) stay fp32,
    exactly as transformers' `from_pretrained(dtype=...)` leaves them."""
    module = module.to(device)
    for param in module.parameters():
        param.data = param.data.to(dtype)
    return module.eval().requires_grad_(False)


def build_embedded_transformer(dtype: torch.dtype, device: torch.device) -> QwenImageTransformer:
    """The tiny DiT with its deterministic weights, hooks run as after loading."""
    model = QwenImageTransformer(EMBEDDED_TRANSFORMER)
    fill_deterministic(model, EMBEDDED_SEED)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.post_load_weights()
    return model


def build_embedded_vae(dtype: torch.dtype, device: torch.device) -> AutoencoderKLQwenImage:
    """A tiny `AutoencoderKLQwenImage` (z_dim 16, 8x spatial) with the real latent statistics."""
    vae = AutoencoderKLQwenImage(**EMBEDDED_VAE)
    fill_deterministic(vae, EMBEDDED_SEED + 1)
    return cast_parameters(vae, dtype, device)


def build_embedded_components(dtype: torch.dtype, device: torch.device) -> Components:
    """All five components of the embedded default model."""
    text_encoder = build_tiny_text_encoder(seed=EMBEDDED_SEED + 2, hidden_size=TEXT_HIDDEN)
    return Components(
        tokenizer=build_qwen2_tokenizer(),
        text_encoder=cast_parameters(text_encoder, dtype, device),
        transformer=build_embedded_transformer(dtype, device),
        vae=build_embedded_vae(dtype, device),
        scheduler=default_scheduler(),
    )
