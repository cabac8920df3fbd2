"""Text and condition images of Qwen-Image 2.1, as diffusers 0.42's `QwenImage21Pipeline` computes them:
the Qwen3-VL prompt embeddings (with the condition images' vision tokens in their slots), where those slots
are, and the condition images' VAE latents. Plain functions over the components.

In diffusers' order: condition images are converted to RGBA and resized once to about `resolution` squared
pixels (`prepare_condition_images`); the vision tower sees them composited over white, the VAE all four
channels. Prompts use the text-to-image template, or with images one `<imageN>` vision slot per image before
the prompt; the processor pads on the left; the last decoder layer's output before the final RMSNorm is
taken (a hook returns the norm's input), the system prompt's tokens are dropped, and the rows are
right-padded per prompt. diffusers' 2.1 pipeline has no `max_sequence_length`: every prompt token is kept.
"""

from dataclasses import dataclass

import PIL.Image
import torch
from diffusers import AutoencoderKLQwenImage21
from diffusers.image_processor import VaeImageProcessor
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import calculate_dimensions
from qwen_image_fusion.models.qwen_image.text_encoder import padded_prompt_rows

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
TEMPLATE = (
    f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
VISION_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"
Grid = tuple[int, int, int]


@dataclass(frozen=True)
class ConditionImages:
    """The request's condition images, resized: RGBA images for the vision tower (flattened over white when
    encoded), the VAE's pixels ([1, 4, 1, H, W] in [-1, 1] each) and each (width, height)."""

    vision: list[PIL.Image.Image]
    pixels: list[torch.Tensor]
    sizes: list[tuple[int, int]]


def prepare_condition_images(
    images: list[PIL.Image.Image], resolution: int, processor: VaeImageProcessor
) -> ConditionImages:
    """Each image as RGBA at about `resolution`^2 pixels of its aspect (multiples of 32), one LANCZOS resize
    for the vision tower and one inside the VAE's preprocessing, as diffusers does."""
    vision, pixels, sizes = [], [], []
    for image in images:
        if image.mode != "RGBA":
            image = image.convert("RGBA")
        width, height = calculate_dimensions(resolution * resolution, image.width / image.height)
        vision.append(processor.resize(image, width=width, height=height))
        pixels.append(processor.preprocess(image, width=width, height=height).unsqueeze(2))
        sizes.append((width, height))
    return ConditionImages(vision, pixels, sizes)


def prompt_texts(prompts: list[str], image_count: int) -> list[str]:
    """The templated prompts: with images, `<image1><vision slot> <image2><vision slot>...` opens the user
    turn; an empty prompt becomes " " (Qwen has no BOS token: the encoder needs something to read)."""
    slots = " ".join(f"<image{i}>{VISION_SLOT}" for i in range(1, image_count + 1))
    return [TEMPLATE.format(slots + (prompt or " ")) for prompt in prompts]


def flatten_alpha(image: PIL.Image.Image) -> PIL.Image.Image:
    """An RGBA image composited over white, as the checkpoint's vision tower was trained."""
    if image.mode != "RGBA":
        return image
    white = PIL.Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white


def system_tokens(processor: Qwen3VLProcessor) -> int:
    """How many leading tokens the system turn takes, by the processor's own chat template (diffusers'
    `_drop_idx`): they are dropped from the hidden states."""
    message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
    return len(processor.apply_chat_template(message, tokenize=True, return_dict=False)[0])


@torch.no_grad()
def encode_prompts21(
    text_encoder: Qwen3VLForConditionalGeneration,
    processor: Qwen3VLProcessor,
    prompts: list[str],
    vision: list[PIL.Image.Image],
    drop: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(prompt embeddings [B, L, hidden], long mask [B, L] or None when nothing is padded, image slots [B, L]
    bool: True where a vision token of a condition image sits), bit-identical to diffusers' `encode_prompt`
    with `vision` (each prompt sees every image). Only the unused logits are skipped."""
    if not prompts:
        raise InputError("at least one prompt is needed")
    inputs = {"text": prompt_texts(prompts, len(vision)), "padding": True, "padding_side": "left"}
    if vision:
        inputs["images"] = [flatten_alpha(image) for _ in prompts for image in vision]
    tokens = processor(**inputs, return_tensors="pt").to(device)
    forward = {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}
    if vision:
        forward |= {"pixel_values": tokens.pixel_values, "image_grid_thw": tokens.image_grid_thw}
    if "mm_token_type_ids" in tokens:
        forward["mm_token_type_ids"] = tokens.mm_token_type_ids
    # transformers 5 returns the final RMSNorm's output as the last hidden state; 2.1 reads its input
    language = getattr(text_encoder.model, "language_model", text_encoder.model)
    handle = language.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        output = text_encoder(**forward, output_hidden_states=True, logits_to_keep=1)
    finally:
        handle.remove()
    embeds, mask = padded_prompt_rows(output.hidden_states[-1], tokens.attention_mask, drop)
    image_id = processor.tokenizer.encode(IMAGE_TOKEN)[0]
    valid = tokens.attention_mask.bool()
    slots = [(ids[keep] == image_id)[drop:] for ids, keep in zip(tokens.input_ids, valid, strict=True)]
    image_slots = torch.stack([torch.cat([s, s.new_zeros(embeds.shape[1] - s.numel())]) for s in slots])
    return embeds.to(device=device, dtype=dtype), None if mask.all() else mask, image_slots


@torch.no_grad()
def encode_condition_latents(
    vae: AutoencoderKLQwenImage21, pixels: list[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, tuple[Grid, ...]]:
    """The condition images' latents, packed unpatched ([1, tokens, z] in image order, in `dtype`) and each
    image's token grid (1, h, w): the mode of the latent distribution, `(z - mean) / std` per channel
    (diffusers' `_encode_vae_image` with `sample_mode="argmax"`), in the VAE's own dtype."""
    z_dim = vae.config.z_dim
    packed, grids = [], []
    for image in pixels:
        latents = vae.encode(image.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()
        shape = (1, z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = ((latents - mean) / std).to(dtype)
        packed.append(pack_unpatched(latents))
        grids.append((1, *latents.shape[3:]))
    return torch.cat(packed, dim=1), tuple(grids)


def pack_unpatched(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, H, W] -> [B, H*W, C]: 2.1's `_pack_latents`, a spatial flatten (a transposed view)."""
    batch, channels, _, height, width = latents.shape
    return latents.view(batch, channels, height * width).transpose(1, 2)


def unpack_unpatched(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, H*W, C] -> [B, C, 1, H, W] (diffusers' `_unpack_latents` of 2.1), contiguous: diffusers' latents
    keep the layout of the transposed view they were packed as, so its VAE reads a contiguous tensor, and the
    VAE's convolutions round otherwise on another memory layout."""
    batch, _, channels = latents.shape
    return latents.transpose(1, 2).reshape(batch, channels, 1, height, width).contiguous()
