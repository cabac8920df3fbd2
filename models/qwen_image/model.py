"""A loaded Qwen-Image checkpoint as the family-neutral pipeline drives it.

Each hook follows diffusers' `QwenImagePipeline` op for op (prompt encoding, seeded noise drawn before
2x2 packing, the transformer call, true CFG rescaled to the conditional norm, VAE decoding with the
config's latent statistics), so the `reference` variant's pixels equal diffusers' on the same weights; an
img2img or inpainting start follows `QwenImageImg2ImgPipeline` / `QwenImageInpaintPipeline`.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import PIL.Image
import torch
import torch.nn.functional as F
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor

from qwen_image_fusion.models.family import (
    Conditioning,
    ControlStart,
    Decoded,
    FamilyModel,
    GenerationDefaults,
    ImageStart,
    QuantRecipe,
    StepCall,
    StepControl,
    parameter_summary,
)
from qwen_image_fusion.models.mask_crop import MaskCrop
from qwen_image_fusion.models.pixels import pil_images
from qwen_image_fusion.models.qwen_image.components import Components, load_components, save_components
from qwen_image_fusion.models.qwen_image.controlnet import ControlImage
from qwen_image_fusion.models.qwen_image.math import ImageLayout, pack_latents, unpack_latents
from qwen_image_fusion.models.qwen_image.text_encoder import encode_prompts, encode_prompts_batched
from qwen_image_fusion.models.vae_decode import decode_frames

OUTSIDE_BLOCKS = (
    "img_in",
    "txt_in",
    "time_text_embed.*",
    "norm_out.linear",
    "proj_out",
    "controlnet_x_embedder",  # a ControlNet's input and its residual projections
    "controlnet_blocks.*",
)
QUANTIZATION = QuantRecipe(
    bf16_fallback=(*OUTSIDE_BLOCKS, "*.img_mod.1", "*.txt_mod.1", "*.img_mlp.net.2"),
    shared_inputs=(("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj")),
    all_blocks_fp8=(*OUTSIDE_BLOCKS, "*.img_mod.1", "*.txt_mod.1"),
    outside_blocks=OUTSIDE_BLOCKS,
    weight_only=("*.img_mod.1", "*.txt_mod.1"),  # the modulation: one input row per sample
)


@dataclass(frozen=True)
class LatentCanvas:
    """A request's latent geometry: latent height and width (even, for 2x2 packing) and the packed grid."""

    height: int
    width: int

    @property
    def grid(self) -> tuple[int, int, int]:
        """(frames, rows, columns) of packed tokens, as the transformer's RoPE reads `img_shapes`."""
        return 1, self.height // 2, self.width // 2


def latent_size(width: int, height: int, vae_scale: int) -> LatentCanvas:
    """The canvas of an image, rounded down to even latent counts for the 2x2 packing (diffusers' rule)."""
    return LatentCanvas(2 * (height // (vae_scale * 2)), 2 * (width // (vae_scale * 2)))


def initial_noise(
    batch: int, channels: int, canvas: LatentCanvas, seed: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Packed Gaussian latents [B, H/2*W/2, 4C] drawn as diffusers draws them (seeded CPU generator)."""
    return draw_noise(batch, channels, canvas, torch.Generator("cpu").manual_seed(seed), device, dtype)


def draw_noise(
    batch: int,
    channels: int,
    canvas: LatentCanvas,
    generator: torch.Generator,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    shape = (batch, 1, channels, canvas.height, canvas.width)
    noise = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
    return pack_latents(noise[:, 0])


def latent_statistics(
    vae: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE config's latent mean and 1 / std as [1, C, 1, 1, 1] on `device` in `dtype` (diffusers' ops:
    the reciprocal taken in that dtype)."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(device, dtype)
    return mean, inv_std


def _crop_args(crop: MaskCrop | None) -> dict[str, Any]:
    """diffusers' preprocessing arguments for a `padding_mask_crop` box: cut it out, then fit it to the size
    ("fill": aspect kept, the rest filled from the box's edges); none without a crop."""
    return {} if crop is None else {"crops_coords": crop.box, "resize_mode": "fill"}


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """`uncond + scale * (cond - uncond)`, rescaled per token to the norm of `cond` (DESIGN §2)."""
    combined = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    combined_norm = torch.norm(combined, dim=-1, keepdim=True)
    return combined * (cond_norm / combined_norm)


class QwenImageModel(FamilyModel):
    """Qwen-Image's components on one device, with the text-to-image hooks of the shared pipeline."""

    quantization = QUANTIZATION

    def __init__(self, components: Components, device: torch.device, dtype: torch.dtype) -> None:
        self.components = components
        self.transformer = components.transformer
        self.device, self.dtype = device, dtype
        self.vae_scale_factor = components.vae_scale_factor
        self.image_processor = VaeImageProcessor(vae_scale_factor=2 * self.vae_scale_factor)
        self.mask_processor = VaeImageProcessor(
            vae_scale_factor=2 * self.vae_scale_factor,
            do_normalize=False,
            do_binarize=True,
            do_convert_grayscale=True,
        )

    @classmethod
    def load(
        cls, directory: Path, dtype: torch.dtype, device: torch.device, vae_dtype: torch.dtype
    ) -> "QwenImageModel":
        return cls(load_components(directory, dtype, device, vae_dtype), device, dtype)

    def encode(
        self, prompts: list[str], max_sequence_length: int, images: list[PIL.Image.Image] | None = None
    ) -> Conditioning:
        c = self.components
        embeds, mask = encode_prompts(
            c.text_encoder, c.tokenizer, prompts, self.device, self.dtype, max_sequence_length
        )
        return Conditioning(embeds, mask)

    def encode_batch(self, prompts: list[str], max_sequence_length: int, rows: int) -> list[Conditioning]:
        """One call of `rows` rows per token bucket (`encode_prompts_batched`: why the bytes hold)."""
        c = self.components
        embeds = encode_prompts_batched(
            c.text_encoder, c.tokenizer, prompts, rows, self.device, self.dtype, max_sequence_length
        )
        return [Conditioning(each, None) for each in embeds]

    def canvas(
        self, width: int, height: int, images: list[PIL.Image.Image] | None = None, prompts: int = 1
    ) -> LatentCanvas:
        return latent_size(width, height, self.vae_scale_factor)

    def initial_latents(self, canvas: LatentCanvas, batch: int, seed: int) -> torch.Tensor:
        channels = self.components.latent_channels
        return initial_noise(batch, channels, canvas, seed, self.device, self.dtype)

    def image_start(
        self,
        image: PIL.Image.Image,
        mask: PIL.Image.Image | None,
        canvas: LatentCanvas,
        batch: int,
        seed: int,
        crop: MaskCrop | None = None,
    ) -> ImageStart:
        """The image resized to the canvas and VAE-encoded (its latent distribution sampled), then the
        noise, from one generator; the mask in grey levels, binarized at 0.5, resized to the latent grid.
        With a `crop`, its box of its image and mask, fitted to the canvas (diffusers' "fill" resize)."""
        generator = torch.Generator("cpu").manual_seed(seed)
        vae, channels = self.components.vae, self.components.latent_channels
        if crop is not None:
            image, mask = crop.image, crop.mask
        pixels = self._pixels(image, canvas, crop).to(torch.float32).unsqueeze(2).to(self.device, self.dtype)
        sampled = retrieve_latents(vae.encode(pixels.to(vae.dtype)), generator=generator)
        mean, inv_std = latent_statistics(vae, sampled.device, sampled.dtype)
        latents = ((sampled - mean) * inv_std).to(self.dtype)
        latents = pack_latents(torch.cat([latents[:, :, 0]] * batch))
        noise = draw_noise(batch, channels, canvas, generator, self.device, self.dtype)
        if mask is None:
            return ImageStart(latents, noise, None)
        height, width = canvas.height * self.vae_scale_factor, canvas.width * self.vae_scale_factor
        grid = self.mask_processor.preprocess(mask, height=height, width=width, **_crop_args(crop))
        grid = F.interpolate(grid, size=(canvas.height, canvas.width))
        grid = grid.to(device=self.device, dtype=self.dtype)
        return ImageStart(latents, noise, pack_latents(grid.repeat(batch, channels, 1, 1)))

    def mask_crop(
        self, image: PIL.Image.Image, mask: PIL.Image.Image, canvas: LatentCanvas, pad: int
    ) -> MaskCrop:
        """The box in the start image itself (`QwenImageInpaintPipeline`): the result comes back at the
        start image's size."""
        height, width = canvas.height * self.vae_scale_factor, canvas.width * self.vae_scale_factor
        return MaskCrop.around(image, mask, width, height, pad)

    def control_start(
        self,
        images: list[PIL.Image.Image],
        mask: PIL.Image.Image | None,
        canvas: LatentCanvas,
        batch: int,
        seed: int,
    ) -> ControlStart:
        """Each control image resized to the canvas, repeated for the batch and VAE-encoded (each row's latent
        distribution sampled in turn), normalized in FP32, then the noise: one generator, the order and ops of
        `QwenImageControlNetPipeline`. With a `mask` (the inpainting ControlNet) the noise comes first and the
        masked image's latents continue the generator (DESIGN §15)."""
        generator = torch.Generator("cpu").manual_seed(seed)
        vae, channels = self.components.vae, self.components.latent_channels
        mean, inv_std = latent_statistics(vae, self.device, torch.float32)
        if mask is not None:
            noise = draw_noise(batch, channels, canvas, generator, self.device, self.dtype)
            return ControlStart((self._masked_control(images[0], mask, canvas, batch, generator),), noise)
        latents = []
        for image in images:
            pixels = self._pixels(image, canvas).repeat_interleave(batch, dim=0).to(self.device, vae.dtype)
            sampled = retrieve_latents(vae.encode(pixels.unsqueeze(2)), generator=generator)
            latents.append(pack_latents(((sampled - mean) * inv_std)[:, :, 0]).to(self.dtype))
        noise = draw_noise(batch, channels, canvas, generator, self.device, self.dtype)
        return ControlStart(tuple(latents), noise)

    def _masked_control(
        self,
        image: PIL.Image.Image,
        mask: PIL.Image.Image,
        canvas: LatentCanvas,
        batch: int,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """The inpainting ControlNet's input (`QwenImageControlNetInpaintPipeline.prepare_image_with_mask`):
        the image with the mask's white part set to -1, VAE-encoded and normalized, beside 1 - the mask
        resized to the latent grid, packed together [B, tokens, 4 (C + 1)]."""
        vae = self.components.vae
        height, width = canvas.height * self.vae_scale_factor, canvas.width * self.vae_scale_factor
        pixels = self._pixels(image, canvas).repeat_interleave(batch, dim=0).to(self.device, vae.dtype)
        grid = self.mask_processor.preprocess(mask, height=height, width=width)
        grid = grid.repeat_interleave(batch, dim=0).to(self.device, vae.dtype).unsqueeze(2)
        masked = pixels.unsqueeze(2).clone()
        masked[(grid > 0.5).repeat(1, 3, 1, 1, 1)] = -1
        sampled = retrieve_latents(vae.encode(masked), generator=generator)
        mean, inv_std = latent_statistics(vae, self.device, torch.float32)
        latents = ((sampled - mean) * inv_std).to(vae.dtype)
        kept = 1 - F.interpolate(grid, size=latents.shape[-3:])
        return pack_latents(torch.cat([latents, kept], dim=1)[:, :, 0]).to(self.dtype)

    def _pixels(
        self, image: PIL.Image.Image, canvas: LatentCanvas, crop: MaskCrop | None = None
    ) -> torch.Tensor:
        """`image` (or the `crop`'s box of it) as RGB at the canvas's pixel size, in [-1, 1] [1, 3, H, W]
        (diffusers' preprocessing)."""
        height, width = canvas.height * self.vae_scale_factor, canvas.width * self.vae_scale_factor
        rgb = image.convert("RGB")
        return self.image_processor.preprocess(rgb, height=height, width=width, **_crop_args(crop))

    def step_call(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        branch: Conditioning,
        canvas: LatentCanvas,
        control: StepControl | None = None,
    ) -> StepCall:
        tensors = (latents, branch.embeds, branch.mask, sigma)
        if control is None:
            return StepCall(tensors, (canvas.grid,))
        positive = (control.positive.embeds, control.positive.mask)
        return StepCall(
            (*tensors, *positive, *control.latents, *control.scales), (canvas.grid, len(control.latents))
        )

    def run_step(
        self,
        latents: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        sigma: torch.Tensor,
        *rest: object,
    ) -> torch.Tensor:
        """The transformer's velocity; `rest` is the grid, or with control `StepControl`'s tensors (positive
        embeddings and mask, each image's latents, then each one's scale), the grid and the image count."""
        if len(rest) == 1:
            return self.transformer(latents, embeds, mask, sigma, rest[0])
        *tensors, grid, count = rest
        positive, positive_mask, *images = tensors
        controls = [
            ControlImage(lat, scale) for lat, scale in zip(images[:count], images[count:], strict=True)
        ]
        rope = self.transformer.rope(ImageLayout.of(grid), positive.shape[1], latents.device)
        residuals = self.components.controlnet.residuals(
            latents, controls, positive, positive_mask, sigma, rope
        )
        return self.transformer(latents, embeds, mask, sigma, grid, residuals)

    def denoise_parts(self) -> dict[str, torch.nn.Module]:
        return self.components.denoise_parts()

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        return true_cfg(cond, uncond, scale)

    def decode(self, latents: torch.Tensor, canvas: LatentCanvas, fast: bool = False) -> Decoded:
        """VAE-decode packed latents to PIL images (the VAE config's latent statistics)."""
        vae = self.components.vae
        z = unpack_latents(latents, canvas.height, canvas.width).to(vae.dtype)
        mean, inv_std = latent_statistics(vae, z.device, z.dtype)
        pixels, report = decode_frames(vae, z / inv_std + mean, fast)
        return Decoded(pil_images(self.image_processor, pixels), report)

    def describe(self) -> list[str]:
        c = self.components
        cfg = self.transformer.config
        return [
            f"transformer: {parameter_summary(c.transformer)}; {cfg.num_layers} layers, width "
            f"{cfg.inner_dim}, {cfg.num_attention_heads} heads x {cfg.attention_head_dim}, text dim "
            f"{cfg.joint_attention_dim}",
            f"text encoder: {type(c.text_encoder).__name__}, {parameter_summary(c.text_encoder)}",
            f"vae: {type(c.vae).__name__}, {parameter_summary(c.vae)}; {c.latent_channels} latent channels, "
            f"{c.vae_scale_factor}x scale",
            f"tokenizer: {type(c.tokenizer).__name__}, vocabulary {len(c.tokenizer)}",
            f"scheduler: {type(c.scheduler).__name__}",
        ]

    def save(self, directory: Path, skip: tuple[str, ...], defaults: GenerationDefaults) -> None:
        save_components(self.components, directory, skip, defaults)


class AppendedImageSteps:
    """The step of a model whose transformer sees the target's tokens followed by a canvas's packed image
    latents (`canvas.references`, [1, tokens, C], laid out by `canvas.layout`) and whose velocity is the
    target's part (Edit's input images, Layered's image)."""

    transformer: torch.nn.Module

    def step_call(
        self, latents: torch.Tensor, sigma: torch.Tensor, branch: Conditioning, canvas: Any
    ) -> StepCall:
        references = canvas.references.expand(latents.shape[0], -1, -1)
        return StepCall((latents, references, branch.embeds, branch.mask, sigma), (canvas.layout,))

    def run_step(
        self,
        latents: torch.Tensor,
        references: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        sigma: torch.Tensor,
        layout: ImageLayout,
    ) -> torch.Tensor:
        out = self.transformer(torch.cat([latents, references], dim=1), embeds, mask, sigma, layout)
        return out[:, : latents.shape[1]]
