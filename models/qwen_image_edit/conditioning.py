"""Image conditioning of the Qwen-Image-Edit family (Edit, Edit-2509, Edit-2511), bit-identical to diffusers
0.42's `QwenImageEditPipeline` (one image) and `QwenImageEditPlusPipeline` (several images): the input
images, the prompt embeddings with vision tokens (transformers' own Qwen2.5-VL vision tower and processor)
and the VAE latents of the reference images. Plain functions: the family-neutral pipeline calls them.

What the pipeline must do, in diffusers' order:
1. Images: `load_edit_image` each input (EXIF rotation, RGB: diffusers' `load_image`; its pipelines fail on
   RGBA or palette images given directly); then `prepare_edit_images`. The output size defaults to
   `config.default_output_size` (from the first image for Edit, the last for Plus), floored to multiples of
   16.
2. Text: `encode_edit_prompts(..., images.condition)` for the prompt, and for a negative prompt with the same
   images (true CFG); Plus takes one prompt per call, Edit one image per prompt.
3. Reference latents: `encode_reference_latents(vae, images.pixels, ...)` once: packed 2x2, concatenated in
   image order, repeated over the batch; with them the transformer's `ImageLayout` (target grid first,
   then `grids`).
4. Every step: the transformer input is `cat([latents, reference_latents], dim=1)` (target tokens first)
   with the layout; its output is cut to the target, `out[:, :latents.shape[1]]`, before true CFG
   (`comb = neg + s * (cond - neg)`, then `comb * ||cond|| / ||comb||` over channels per token) and the
   scheduler step. The scheduler's `mu` counts the target's tokens only (`latents.shape[1]`), with
   diffusers' fallbacks `max_image_seq_len` 4096 and `max_shift` 1.15 where the scheduler config lacks them.
   Edit-2511 (`zero_cond_t`) needs nothing more here: the transformer derives the per-token modulation
   rows from the layout.
5. Edit's prompt encoding ignores `max_sequence_length` (diffusers passes it nowhere), unlike text-to-image.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import PIL.Image
import PIL.ImageOps
import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.image_processor import VaeImageProcessor
from transformers import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLProcessor,
)

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import calculate_dimensions
from qwen_image_fusion.models.qwen_image.math import pack_latents
from qwen_image_fusion.models.qwen_image.text_encoder import padded_prompt_rows
from qwen_image_fusion.models.qwen_image_edit.config import CONDITION_AREA, VAE_AREA, EditKind
from qwen_image_fusion.models.vl_processor import load_vl_processor

Grid = tuple[int, int, int]

SYSTEM_PROMPT = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate.<|im_end|>\n<|im_start|>user\n"
)
VISION_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
EDIT_TEMPLATE = SYSTEM_PROMPT + VISION_SLOT + "{}<|im_end|>\n<|im_start|>assistant\n"
PLUS_TEMPLATE = SYSTEM_PROMPT + "{}<|im_end|>\n<|im_start|>assistant\n"
PICTURE_LABEL = "Picture {}: " + VISION_SLOT
EDIT_DROP_TOKENS = 64  # the system part and "<|im_start|>user\n"


def load_edit_image(image: PIL.Image.Image) -> PIL.Image.Image:
    """An input image as diffusers' `load_image` returns it: EXIF orientation applied, converted to RGB."""
    return PIL.ImageOps.exif_transpose(image).convert("RGB")


@dataclass(frozen=True)
class EditImages:
    """The prepared input images: what the vision tower sees, the VAE's pixels ([1, 3, 1, H, W] in
    [-1, 1] each), and each input's own (width, height)."""

    condition: list[PIL.Image.Image]
    pixels: list[torch.Tensor]
    sizes: list[tuple[int, int]]


@functools.cache
def _vae_image_processor(vae_scale_factor: int) -> VaeImageProcessor:
    """diffusers' image processor as the Edit pipelines build it (LANCZOS resize, [-1, 1])."""
    return VaeImageProcessor(vae_scale_factor=vae_scale_factor * 2)


def prepare_edit_images(
    images: list[PIL.Image.Image],
    kind: EditKind,
    vae_scale_factor: int,
    vae_area: float = VAE_AREA,
    condition_area: float = CONDITION_AREA,
) -> EditImages:
    """Resize and normalize RGB images as the Edit pipelines do: Edit resizes its one image to `vae_area`
    for both the vision tower and the VAE; Plus gives the vision tower each image at `condition_area` and
    the VAE each image at `vae_area`. The areas are parameters so tests can run small."""
    if not images:
        raise InputError("an edit needs at least one input image")
    if not kind.plus and len(images) > 1:
        raise InputError(f"{kind.pipeline_class} takes one input image, got {len(images)}")
    processor = _vae_image_processor(vae_scale_factor)
    if kind.plus:
        condition, pixels = [], []
        for image in images:
            width, height = calculate_dimensions(condition_area, _ratio(image))
            condition.append(processor.resize(image, height, width))
            width, height = calculate_dimensions(vae_area, _ratio(image))
            pixels.append(processor.preprocess(image, height, width).unsqueeze(2))
        return EditImages(condition, pixels, [image.size for image in images])
    width, height = calculate_dimensions(vae_area, _ratio(images[0]))
    resized = processor.resize(images[0], height, width)
    pixels = processor.preprocess(resized, height, width).unsqueeze(2)
    return EditImages([resized], [pixels], [images[0].size])


def _ratio(image: PIL.Image.Image) -> float:
    return image.size[0] / image.size[1]


def edit_prompt_texts(prompts: list[str], image_count: int, kind: EditKind) -> list[str]:
    """The templated texts: Plus labels every image ("Picture 1: <vision>Picture 2: <vision>...")."""
    labels = "".join(PICTURE_LABEL.format(i + 1) for i in range(image_count)) if kind.plus else ""
    template = PLUS_TEMPLATE if kind.plus else EDIT_TEMPLATE
    return [template.format(labels + prompt) for prompt in prompts]


@torch.no_grad()
def encode_edit_prompts(
    text_encoder: Qwen2_5_VLForConditionalGeneration,
    processor: Qwen2VLProcessor,
    prompts: list[str],
    images: list[PIL.Image.Image],
    kind: EditKind,
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt embeddings [B, L, hidden] and their long mask (None when every token is valid), the same ops
    as diffusers' `encode_prompt(prompts, image=images)` of the Edit pipeline `kind`: the processor puts
    each image's vision tokens in its slot, the first 64 tokens of the last hidden state are dropped."""
    if not prompts:
        raise InputError("at least one prompt is needed")
    if kind.plus and len(prompts) != 1:
        raise InputError(f"{kind.pipeline_class} encodes one prompt per call, got {len(prompts)}")
    if not kind.plus and len(images) != len(prompts):
        raise InputError(
            f"{kind.pipeline_class} encodes one image per prompt: "
            f"{len(prompts)} prompt(s), {len(images)} image(s)"
        )
    inputs = processor(
        text=edit_prompt_texts(prompts, len(images), kind), images=images, padding=True, return_tensors="pt"
    ).to(device)
    output = text_encoder(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        pixel_values=inputs["pixel_values"],
        image_grid_thw=inputs["image_grid_thw"],
        output_hidden_states=True,
        logits_to_keep=1,
    )
    embeds, mask = padded_prompt_rows(output.hidden_states[-1], inputs["attention_mask"], EDIT_DROP_TOKENS)
    return embeds.to(dtype=dtype, device=device), None if mask.all() else mask


@torch.no_grad()
def encode_reference_latents(
    vae: AutoencoderKLQwenImage,
    pixels: list[torch.Tensor],
    batch: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, tuple[Grid, ...]]:
    """Packed reference latents [batch, tokens, 4 z] in image order and each image's token grid (F, H, W).

    As diffusers' `_encode_vae_image` + `prepare_latents`: pixels in `dtype` (the prompt embeddings'),
    the mode of the latent distribution, `(z - latents_mean) / latents_std`, repeated over the batch.
    """
    z_dim = vae.config.z_dim
    packed, grids = [], []
    for image in pixels:
        latents = vae.encode(image.to(device=device, dtype=dtype)).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        latents = ((latents - mean) / std)[:, :, 0]
        if batch % latents.shape[0]:
            raise InputError(f"cannot repeat {latents.shape[0]} reference image(s) over a batch of {batch}")
        latents = torch.cat([latents] * (batch // latents.shape[0]), dim=0)
        packed.append(pack_latents(latents))
        grids.append((1, latents.shape[2] // 2, latents.shape[3] // 2))
    return torch.cat(packed, dim=1), tuple(grids)


def load_processor(directory: Path, backend: str = "auto") -> Qwen2VLProcessor:
    """The Qwen2-VL processor of a checkpoint's `processor/` folder (models/vl_processor.py: torchvision's
    image backend where it is installed, else PIL's)."""
    return load_vl_processor(directory, Qwen2VLProcessor, backend)
