"""Tiny Qwen-Image-Edit checkpoints for tests, built with diffusers' and transformers' own classes and
written in diffusers layout, so `QwenImageEditPipeline` / `QwenImageEditPlusPipeline.from_pretrained(dir)`
loads them: model_index.json's `_class_name` names the pipeline; `transformer/` is diffusers'
`QwenImageTransformer2DModel` (`zero_cond_t` on or off), `text_encoder/` a tiny Qwen2.5-VL with its vision
tower, `processor/` the Qwen2-VL image processor config and the real Qwen2 tokenizer, `vae/` a tiny
`AutoencoderKLQwenImage`, `tokenizer/`, `scheduler/`. Also our own tiny Edit-2511 transformer, its
ModelOpt-style FP8 version and step inputs over an Edit layout (target grid, then reference grids).

Without torchvision (our CPU install) transformers cannot build `Qwen2VLProcessor` itself (its video processor
needs torchvision), so `diffusers_edit_pipeline` hands diffusers the processor that
`qwen_image_fusion.models.qwen_image_edit.conditioning.load_processor` builds from the same folder;
`small_edit_areas` shrinks diffusers' fixed 1024x1024 and 384x384 image areas so the pipelines run in seconds
on a CPU.
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage import (
    pipeline_qwenimage_edit,
    pipeline_qwenimage_edit_inpaint,
    pipeline_qwenimage_edit_plus,
)
from helpers import fill_deterministic, vocab_and_merges_layout
from transformers import Qwen2VLImageProcessorPil

from qwen_image_fusion.models.calibration import (
    fp8_state_dict,
    quantizable_linears,
    record_input_amax,
    share_group_amax,
)
from qwen_image_fusion.models.loading import transformer_from_state
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.qwen_image.components import default_scheduler
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.math import ImageLayout
from qwen_image_fusion.models.qwen_image.model import QUANTIZATION
from qwen_image_fusion.models.qwen_image.text_encoder import build_tiny_text_encoder
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer
from qwen_image_fusion.models.qwen_image_edit.conditioning import load_edit_image, load_processor

PIPELINES = {cls.__name__: cls for cls in (QwenImageEditPipeline, QwenImageEditPlusPipeline)}
TEXT_HIDDEN = 64
TRANSFORMER = dict(
    num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=TEXT_HIDDEN,
    axes_dims_rope=(8, 12, 12),
)  # fmt: skip
SMALL_VAE_AREA = 96 * 96
SMALL_CONDITION_AREA = 64 * 64


def tiny_vae(seed: int, base_dim: int = 8) -> AutoencoderKLQwenImage:
    """An 8x, z_dim 16 VAE at base width `base_dim` with latent statistics that are not 0 / 1."""
    vae = AutoencoderKLQwenImage(
        base_dim=base_dim,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.05 * i - 0.3 for i in range(16)],
        latents_std=[1.0 + 0.1 * i for i in range(16)],
    )
    fill_deterministic(vae, seed)
    return vae.eval()


def build_edit_checkpoint(
    directory: Path, pipeline_class: str, zero_cond_t: bool, seed: int = 0, vae_base_dim: int = 8
) -> Path:
    """Random weights in diffusers' and transformers' classes, saved by their `save_pretrained` (the
    processor as its image processor and tokenizer: the processor's own save needs a video processor); a
    smaller `vae_base_dim` makes the VAE cheaper where a test runs it at diffusers' full image areas."""
    transformer = QwenImageTransformer2DModel(**TRANSFORMER, zero_cond_t=zero_cond_t)
    fill_deterministic(transformer, seed)
    tokenizer = build_qwen2_tokenizer()
    pipe = PIPELINES[pipeline_class](
        scheduler=default_scheduler(),
        vae=tiny_vae(seed + 1, vae_base_dim),
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


EDIT_VARIANTS = {  # name: (pipeline class, zero_cond_t): Edit, and Plus as Edit-2509 and Edit-2511 are
    "edit": ("QwenImageEditPipeline", False),
    "plus-2509": ("QwenImageEditPlusPipeline", False),
    "plus-2511": ("QwenImageEditPlusPipeline", True),
}


def build_edit_checkpoints(root: Path, seeds: dict[str, int]) -> dict[str, Path]:
    """Tiny checkpoints of the named EDIT_VARIANTS under `root`, each with its own seed."""
    return {
        name: build_edit_checkpoint(root / name, *EDIT_VARIANTS[name], seed) for name, seed in seeds.items()
    }


def diffusers_edit_pipeline(directory: Path, dtype: torch.dtype = torch.float32) -> Any:
    """diffusers' own Edit pipeline of `directory` (the class model_index.json names), loaded by its
    `from_pretrained`; the processor comes from `load_processor` (transformers' PIL backend here)."""
    pipeline_class = PIPELINES[json.loads((directory / "model_index.json").read_text())["_class_name"]]
    pipe = pipeline_class.from_pretrained(
        directory, processor=load_processor(directory / "processor"), dtype=dtype
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def our_edit_pipeline(directory: Path, dtype: torch.dtype = torch.float32, variant: str = "reference") -> Any:
    """Our pipeline of `directory` on the CPU, with the image areas `small_edit_areas` gives diffusers."""
    from qwen_image_fusion.pipelines import load_pipeline

    pipe = load_pipeline(directory, variant=variant, device="cpu", dtype=dtype)
    pipe.model.vae_area, pipe.model.condition_area = SMALL_VAE_AREA, SMALL_CONDITION_AREA
    return pipe


def our_inpaint_pipeline(
    directory: Path, dtype: torch.dtype = torch.float32, variant: str = "reference"
) -> Any:
    """`our_edit_pipeline` whose Edit output size is its image's at the small VAE area: diffusers' inpainting
    edit computes both in one call, which `small_edit_areas` shrinks (at diffusers' areas they are equal)."""
    pipe = our_edit_pipeline(directory, dtype, variant)
    pipe.model.default_size = lambda images: pipe.model.prepare(images).condition[0].size
    return pipe


@contextmanager
def small_edit_areas(
    vae_area: int = SMALL_VAE_AREA, condition_area: int = SMALL_CONDITION_AREA
) -> Iterator[None]:
    """Run diffusers' Edit pipelines with smaller image areas than their fixed 1024x1024 (VAE) and 384x384
    (Plus vision) ones: Plus reads module constants, Edit and Edit inpainting call
    `calculate_dimensions(1024 * 1024, ...)`."""
    plus, edit, inpaint = (
        pipeline_qwenimage_edit_plus,
        pipeline_qwenimage_edit,
        pipeline_qwenimage_edit_inpaint,
    )
    saved = (
        plus.VAE_IMAGE_SIZE,
        plus.CONDITION_IMAGE_SIZE,
        edit.calculate_dimensions,
        inpaint.calculate_dimensions,
    )
    originals = edit.calculate_dimensions, inpaint.calculate_dimensions
    plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE = vae_area, condition_area
    edit.calculate_dimensions = lambda target_area, ratio: originals[0](vae_area, ratio)
    inpaint.calculate_dimensions = lambda target_area, ratio: originals[1](vae_area, ratio)
    try:
        yield
    finally:
        (
            plus.VAE_IMAGE_SIZE,
            plus.CONDITION_IMAGE_SIZE,
            edit.calculate_dimensions,
            inpaint.calculate_dimensions,
        ) = saved


def diffusers_edit(
    pipe: Any,
    prompts: list[str],
    images: list[PIL.Image.Image],
    negative: str | None,
    size: tuple[int, int],
    steps: int = 2,
    true_cfg_scale: float = 4.0,
    per_prompt: int = 1,
    seed: int = 0,
) -> list[PIL.Image.Image]:
    """diffusers' Edit pipeline on `load_image`-converted images at the small image areas. Edit takes one
    image, or a list with one per prompt for a prompt batch (its vision tower then sees them unresized:
    give an image already at the resized size and that path computes what one shared image does)."""
    rgb = [load_edit_image(image) for image in images]
    plus = isinstance(pipe, QwenImageEditPlusPipeline)
    batch = len(prompts) > 1
    image = rgb if plus else rgb * len(prompts) if batch else rgb[0]
    negatives = [negative] * len(prompts) if batch and negative else negative
    width, height = size
    with small_edit_areas():
        return pipe(
            image=image,
            prompt=prompts if batch else prompts[0],
            negative_prompt=negatives,
            true_cfg_scale=true_cfg_scale,
            width=width,
            height=height,
            num_inference_steps=steps,
            num_images_per_prompt=per_prompt,
            generator=torch.Generator().manual_seed(seed),
        ).images


def drawn_image(width: int, height: int, seed: int, mode: str = "RGB") -> PIL.Image.Image:
    """A deterministic test image: smooth colour ramps plus seeded noise, in PIL `mode` (RGB, RGBA with a
    varying alpha, or P: a 256-colour palette)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    ramps = np.stack([x / width, y / height, (x + y) / (width + height), 1 - x / width], axis=-1)
    pixels = np.clip(255 * ramps + rng.normal(0, 24, ramps.shape), 0, 255).astype(np.uint8)
    if mode == "RGBA":
        return PIL.Image.fromarray(pixels, "RGBA")
    image = PIL.Image.fromarray(pixels[..., :3], "RGB")
    return image.convert("P", palette=PIL.Image.Palette.ADAPTIVE) if mode == "P" else image


EDIT_2511 = QwenImageConfig(
    num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48,
    axes_dims_rope=(8, 12, 12), zero_cond_t=True,
)  # fmt: skip
EDIT_LAYOUT = ImageLayout((1, 3, 3), ((1, 5, 3), (1, 2, 7)))  # odd target and reference grids


def edit_step_inputs(
    batch: int, layout: ImageLayout, text: int, dtype: torch.dtype, padded: bool, text_dim: int = 48
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(latents [B, tokens, 64], prompt embeddings, long mask with sample 0 padded from text // 2 or None,
    sigmas) of one seeded transformer step."""
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, layout.tokens, 64, generator=gen).to(dtype)
    prompt = torch.randn(batch, text, text_dim, generator=gen).to(dtype)
    mask = None
    if padded:
        mask = torch.ones(batch, text, dtype=torch.long)
        mask[0, text // 2 :] = 0
    return latents, prompt, mask, torch.rand(batch, generator=gen)


def tiny_edit_transformer(config: QwenImageConfig = EDIT_2511, seed: int = 5) -> QwenImageTransformer:
    """Our transformer with seeded weights in BF16 (the same on every rank and run)."""
    model = QwenImageTransformer(config)
    fill_deterministic(model, seed)
    return model.to(torch.bfloat16).eval()


def meta_transformer(config: QwenImageConfig) -> QwenImageTransformer:
    """Our DiT for `config` on the meta device (shapes only), for `transformer_from_state`."""
    with torch.device("meta"):
        return QwenImageTransformer(config)


def fp8_edit_transformer(config: QwenImageConfig = EDIT_2511, seed: int = 5) -> QwenImageTransformer:
    """`tiny_edit_transformer` in ModelOpt FP8 (every block linear), calibrated on one Edit step."""
    model = tiny_edit_transformer(config, seed)
    linears = quantizable_linears(model, QUANTIZATION.all_blocks_fp8)
    with torch.no_grad(), record_input_amax(linears) as amax:
        model(*edit_step_inputs(2, EDIT_LAYOUT, 9, torch.bfloat16, True), EDIT_LAYOUT)
    state = fp8_state_dict(model, linears, share_group_amax(amax, QUANTIZATION.shared_inputs))
    quant = QuantConfig("FP8", tuple(QUANTIZATION.all_blocks_fp8))
    return transformer_from_state(meta_transformer(config), state, quant, torch.bfloat16, Path("edit-fp8"))


@contextmanager
def transformer_calls(pipe: Any) -> Iterator[list[dict[str, Any]]]:
    """Record the keyword inputs and the output of every call of `pipe.transformer` while active."""
    calls: list[dict[str, Any]] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        calls.append({**kwargs, "output": output[0]})

    handle = pipe.transformer.register_forward_hook(record, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
