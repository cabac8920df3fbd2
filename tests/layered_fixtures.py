"""Tiny Qwen-Image-Layered checkpoints for tests, built with diffusers' and transformers' own classes and
written in diffusers layout, so `QwenImageLayeredPipeline.from_pretrained(dir)` loads them: the transformer
with Layered's flags (`use_additional_t_cond`, `use_layer3d_rope`) or without them (as diffusers' own
Layered tests build it), an RGBA (4-channel) or RGB VAE, and the processor folder the pipeline lists.

diffusers' pipeline only takes the 640 and 1024 buckets; `small_layered_area` makes its bucket smaller, so
the oracles run in seconds on a CPU (the request gives us the same size as width and height).
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import PIL.Image
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageLayeredPipeline, QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered
from edit_fixtures import TEXT_HIDDEN, TRANSFORMER
from helpers import fill_deterministic, vocab_and_merges_layout
from transformers import Qwen2VLImageProcessorPil

from qwen_image_fusion.models.family import calculate_dimensions
from qwen_image_fusion.models.qwen_image.components import default_scheduler
from qwen_image_fusion.models.qwen_image.text_encoder import build_tiny_text_encoder
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer
from qwen_image_fusion.models.qwen_image_edit.conditioning import load_processor

SMALL_AREA = 96 * 96


def tiny_rgba_vae(seed: int, channels: int = 4, base_dim: int = 8) -> AutoencoderKLQwenImage:
    """An 8x, z_dim 16 VAE reading `channels` pixel channels, latent statistics that are not 0 / 1."""
    vae = AutoencoderKLQwenImage(
        base_dim=base_dim,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.04 * i - 0.3 for i in range(16)],
        latents_std=[1.0 + 0.1 * i for i in range(16)],
        input_channels=channels,
    )
    fill_deterministic(vae, seed)
    return vae.eval()


def build_layered_checkpoint(
    directory: Path, flags: bool = True, channels: int = 4, seed: int = 0, vae_base_dim: int = 8
) -> Path:
    """Random weights in diffusers' and transformers' classes, saved by their `save_pretrained`; a smaller
    `vae_base_dim` makes the VAE cheaper where a test runs it at a full bucket's size."""
    transformer = QwenImageTransformer2DModel(
        **TRANSFORMER, use_additional_t_cond=flags, use_layer3d_rope=flags
    )
    fill_deterministic(transformer, seed)
    tokenizer = build_qwen2_tokenizer()
    pipe = QwenImageLayeredPipeline(
        scheduler=default_scheduler(),
        vae=tiny_rgba_vae(seed + 1, channels, vae_base_dim),
        text_encoder=build_tiny_text_encoder(seed=seed + 2, hidden_size=TEXT_HIDDEN),
        tokenizer=tokenizer,
        processor=None,
        transformer=transformer.eval(),
    )
    pipe.save_pretrained(directory)
    Qwen2VLImageProcessorPil().save_pretrained(directory / "processor")
    tokenizer.save_pretrained(directory / "processor")
    for folder in ("tokenizer", "processor"):
        vocab_and_merges_layout(directory / folder)
    index = json.loads((directory / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))
    return directory


def diffusers_layered_pipeline(directory: Path, dtype: torch.dtype = torch.float32) -> Any:
    pipe = QwenImageLayeredPipeline.from_pretrained(
        directory, processor=load_processor(directory / "processor"), dtype=dtype
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@contextmanager
def small_layered_area(area: int = SMALL_AREA) -> Iterator[None]:
    """diffusers' Layered pipeline with its bucket's area replaced by `area`."""
    original = pipeline_qwenimage_layered.calculate_dimensions
    pipeline_qwenimage_layered.calculate_dimensions = lambda target_area, ratio: original(area, ratio)
    try:
        yield
    finally:
        pipeline_qwenimage_layered.calculate_dimensions = original


def small_size(image: PIL.Image.Image, area: int = SMALL_AREA) -> tuple[int, int]:
    """The (width, height) diffusers' Layered pipeline picks for `image` under `small_layered_area`."""
    width, height = calculate_dimensions(area, image.width / image.height)
    return width // 16 * 16, height // 16 * 16


def diffusers_layers(
    pipe: Any,
    image: PIL.Image.Image,
    prompts: list[str],
    negative: str | None,
    layers: int,
    steps: int = 2,
    true_cfg_scale: float = 4.0,
    per_prompt: int = 1,
    seed: int = 0,
) -> list[PIL.Image.Image]:
    """diffusers' layers of `image` at the small area, flattened (each image's layers in a row)."""
    batch = len(prompts) > 1
    with small_layered_area():
        out = pipe(
            image=image,
            prompt=prompts if batch else prompts[0],
            negative_prompt=[negative] * len(prompts) if batch and negative else negative,
            true_cfg_scale=true_cfg_scale,
            layers=layers,
            num_inference_steps=steps,
            num_images_per_prompt=per_prompt,
            generator=torch.Generator().manual_seed(seed),
        ).images
    return [layer for group in out for layer in group]
