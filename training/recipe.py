"""What the trained default model is made of: sizes per preset and how each component is built.

Shared by `train_default` (which trains the VAE and the DiT) and `assemble` (which adds the frozen text
encoder, tokenizer and scheduler to make a checkpoint), so both build the identical text encoder.
"""

import math
from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKLQwenImage
from transformers import Qwen2_5_VLForConditionalGeneration

from qwen_image_fusion.models.family import GenerationDefaults
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.text_encoder import build_tiny_text_encoder
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer

TEXT_ENCODER_SEED = 15_2025
NEGATIVE_PROMPT = " "  # what text dropout trains as the unconditional branch: use it as the negative prompt
SAMPLE_STEPS = 20
SAMPLE_CFG_SCALE = 4.0


def sampling_defaults(image_size: int) -> GenerationDefaults:
    """How the run samples its held-out captions, and so the assembled checkpoint's generation defaults:
    its image size, 20 steps, true CFG 4 with the negative prompt text dropout trained."""
    return GenerationDefaults(image_size, image_size, SAMPLE_STEPS, SAMPLE_CFG_SCALE, NEGATIVE_PROMPT)


def dit_config(width: int, layers: int, text_hidden: int) -> QwenImageConfig:
    """Our DiT with 32-wide heads (RoPE axes 8/12/12, as the embedded default)."""
    return QwenImageConfig(
        num_layers=layers,
        attention_head_dim=32,
        num_attention_heads=width // 32,
        joint_attention_dim=text_hidden,
        axes_dims_rope=(8, 12, 12),
    )


@dataclass(frozen=True)
class Recipe:
    """Model sizes and a training budget; fixed step counts and batch sizes, so a seed reproduces a run."""

    image_size: int
    dit: QwenImageConfig
    vae: dict = field(hash=False)
    text_hidden: int
    scenes: int
    vae_steps: int
    vae_batch: int
    vae_lr: float
    dit_steps: int
    dit_batch: int
    dit_lr: float
    held_out_samples: int = 100  # held-out scenes reconstructed by the VAE and generated after training


def vae_config(base_dim: int) -> dict:
    """`AutoencoderKLQwenImage` at `base_dim` channels: z_dim 16 and 8x spatial, as the pipeline assumes."""
    return {"base_dim": base_dim, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1}


RECIPES = {
    # The shipped model: 256 px, DiT width 128 x 6 layers, VAE base 12; each stage fills one H200 call
    # (probe: VAE 6.5 steps/s, DiT 16.9 steps/s; training/README.md, "The shipped model").
    "default": Recipe(
        image_size=256,
        dit=dit_config(128, 6, 32),
        vae=vae_config(12),
        text_hidden=32,
        scenes=60_000,
        vae_steps=2_700,
        vae_batch=64,
        vae_lr=5e-4,
        dit_steps=7_000,
        dit_batch=256,
        dit_lr=5e-4,
    ),
    # The CPU de-risk: same recipe at 64 px with a narrower DiT and VAE, minutes on two cores.
    "cpu": Recipe(
        image_size=64,
        dit=dit_config(64, 4, 32),
        vae=vae_config(8),
        text_hidden=32,
        scenes=4_000,
        vae_steps=3_000,
        vae_batch=8,
        vae_lr=5e-4,
        dit_steps=1_500,
        dit_batch=64,
        dit_lr=1e-3,
    ),
    # End to end in seconds (tests): the smallest sizes every component accepts.
    "smoke": Recipe(
        image_size=32,
        dit=dit_config(32, 1, 32),
        vae=vae_config(4),
        text_hidden=32,
        scenes=24,
        vae_steps=2,
        vae_batch=4,
        vae_lr=1e-3,
        dit_steps=3,
        dit_batch=4,
        dit_lr=1e-3,
        held_out_samples=2,
    ),
}


def build_text_encoder(hidden_size: int) -> Qwen2_5_VLForConditionalGeneration:
    """The frozen text encoder: Qwen2.5-VL architecture, deterministic random weights, input and output
    embeddings tied so the 152064-row vocabulary is stored once."""
    model = build_tiny_text_encoder(seed=TEXT_ENCODER_SEED, hidden_size=hidden_size)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    return model.requires_grad_(False)


def build_vae(config: dict) -> AutoencoderKLQwenImage:
    """A fresh VAE (diffusers' initialisation, drawn from torch's seeded global generator)."""
    return AutoencoderKLQwenImage(**config)


def build_transformer(config: QwenImageConfig, seed: int) -> QwenImageTransformer:
    """A fresh DiT with DiT's initialisation: Xavier-uniform linears, zero biases, unit norms, and zero
    modulation and output projections (adaLN-zero: every block starts as the identity)."""
    model = QwenImageTransformer(config)
    generator = torch.Generator().manual_seed(seed)
    zeroed = (".img_mod.", ".txt_mod.", "norm_out.linear", "proj_out")
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if any(part in f".{name}" for part in zeroed) or name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)
            else:
                fan_out, fan_in = param.shape
                bound = math.sqrt(6.0 / (fan_in + fan_out))
                param.uniform_(-bound, bound, generator=generator)
    return model


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Move to `device` and cast parameters only: fp32 buffers (RoPE inverse frequencies) stay fp32,
    exactly as transformers' `from_pretrained(dtype=...)` leaves them."""
    module = module.to(device)
    for param in module.parameters():
        param.data = param.data.to(dtype)
    return module.eval().requires_grad_(False)
