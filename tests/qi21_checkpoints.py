"""Tiny Qwen-Image 2.1 checkpoints for pipeline tests, built with diffusers' and transformers' own classes
and written by their `save_pretrained` in diffusers layout, so that diffusers'
`QwenImage21Pipeline.from_pretrained` loads them as it would the released model: `transformer/`
(`QwenImage21Transformer2DModel`, causal condition on or off), `text_encoder/` (a tiny Qwen3-VL with its
vision tower and deepstack), `processor/` (Qwen3-VL's image processor, the real Qwen2 byte-level tokenizer,
a chat template), `vae/` (a tiny 16x `AutoencoderKLQwenImage21` with latent statistics that are not 0 / 1),
`scheduler/`; `sample_sigmas` in model_index.json for a Turbo one.

Without torchvision (our CPU install) transformers cannot build `Qwen3VLProcessor` itself, so
`diffusers_pipeline` hands diffusers the processor `qwen_image_fusion.models.vl_processor.load_vl_processor`
builds from the same folder (transformers' PIL image backend). `RESOLUTION` is diffusers' `output_resolution`
for these tests: condition images are resized to about 64x64 pixels (4x4 latent tokens), so a call takes
seconds.
"""

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
from helpers import fill_deterministic, vocab_and_merges_layout
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from qwen_image_fusion.models.qwen_image.components import default_scheduler
from qwen_image_fusion.models.qwen_image21 import synthetic
from qwen_image_fusion.models.qwen_image21.components import save_processor
from qwen_image_fusion.models.vl_processor import load_vl_processor

TEXT_HIDDEN = synthetic.TOY_TEXT["hidden_size"]
Z_DIM = 16
RESOLUTION = 64
TRANSFORMER = dict(
    patch_size=1, in_channels=Z_DIM, out_channels=Z_DIM, num_layers=2, attention_head_dim=32,
    num_attention_heads=2, context_in_dim=TEXT_HIDDEN, axes_dims_rope=(8, 12, 12),
)  # fmt: skip
TURBO_SIGMAS = [1.0, 0.9, 0.7, 0.4]


def tiny_text_encoder(seed: int) -> Qwen3VLForConditionalGeneration:
    """Qwen3-VL's architecture at toy sizes: 2 layers of width 64 (4 heads, 2 KV heads, interleaved M-RoPE),
    the real vocabulary, a 1-block vision tower (patch 16, merge 2) feeding deepstack layer 0."""
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(
        synthetic.text_encoder_config(synthetic.TOY_TEXT, synthetic.TOY_VISION)
    ).eval()


def tiny_vae(seed: int) -> AutoencoderKLQwenImage21:
    vae = AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=Z_DIM,
        dim_mult=[1, 1, 2, 2, 2],
        num_res_blocks=1,
        latents_mean=[0.05 * i - 0.3 for i in range(Z_DIM)],
        latents_std=[1.0 + 0.1 * i for i in range(Z_DIM)],
    )
    fill_deterministic(vae, seed)
    return vae.eval()


def build_qi21_checkpoint(
    directory: Path,
    seed: int = 0,
    causal_condition: bool = True,
    sample_sigmas: list[float] | None = None,
    num_layers: int = TRANSFORMER["num_layers"],
) -> Path:
    """Random weights in diffusers' and transformers' classes, each saved by its own `save_pretrained` (the
    processor as its image processor, tokenizer and chat template: its own save needs a video processor)."""
    config = TRANSFORMER | {"num_layers": num_layers, "causal_condition": causal_condition}
    transformer = QwenImage21Transformer2DModel(**config)
    fill_deterministic(transformer, seed)
    transformer.eval().save_pretrained(directory / "transformer")
    tiny_text_encoder(seed + 1).save_pretrained(directory / "text_encoder")
    tiny_vae(seed + 2).save_pretrained(directory / "vae")
    default_scheduler().save_pretrained(directory / "scheduler")
    save_processor(synthetic.processor(min_pixels=32 * 32), directory / "processor")  # toy images: 64x64
    vocab_and_merges_layout(directory / "processor")
    index: dict[str, Any] = {
        "_class_name": "QwenImage21Pipeline",
        "_diffusers_version": "0.42.1",
        "processor": ["transformers", "Qwen3VLProcessor"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage21"],
    }
    if sample_sigmas is not None:
        index["sample_sigmas"] = sample_sigmas
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))
    return directory


def diffusers_pipeline(directory: Path, dtype: torch.dtype = torch.float32) -> QwenImage21Pipeline:
    """diffusers' own 2.1 pipeline of `directory`, loaded by its `from_pretrained` (the processor from
    `load_vl_processor`: transformers' PIL backend here)."""
    processor = load_vl_processor(directory / "processor", Qwen3VLProcessor)
    pipe = QwenImage21Pipeline.from_pretrained(directory, processor=processor, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe
