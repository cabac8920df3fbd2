"""A loaded Qwen-Image-Layered checkpoint as the family-neutral pipeline drives it.

Each hook follows diffusers' `QwenImageLayeredPipeline` op for op: the input image resized to the output
size and VAE-encoded (the mode of its latent distribution), its tokens appended after the target's at every
step; the target is `layers + 1` frames (the first is the whole image again), drawn as one noise tensor and
packed frame by frame; sigmas from 1 down to 1/n and a time shift from the image's token count; true CFG
without rescaling (`cfg_normalize=False`, diffusers' default); each frame but the first decoded to an RGBA
image. Prompt encoding is Qwen-Image's (the same template). So the `reference` variant's pixels equal
diffusers' on the same weights and image.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from diffusers.utils.torch_utils import randn_tensor

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import Decoded, calculate_dimensions
from qwen_image_fusion.models.pixels import pil_images
from qwen_image_fusion.models.qwen_image.math import ImageLayout, pack_latents, unpack_latents
from qwen_image_fusion.models.qwen_image.model import (
    AppendedImageSteps,
    LatentCanvas,
    QwenImageModel,
    latent_size,
    latent_statistics,
)
from qwen_image_fusion.models.qwen_image_edit.conditioning import encode_reference_latents
from qwen_image_fusion.models.qwen_image_layered.caption import caption_image
from qwen_image_fusion.models.qwen_image_layered.components import LayeredComponents, load_layered_components
from qwen_image_fusion.models.vae_decode import decode_frames

DEFAULT_RESOLUTION = 640  # diffusers' default bucket: the output is about 640 x 640 at the image's aspect
BASE_TOKENS = 256  # the time shift's base token count: mu = sqrt(condition tokens / 256)


@dataclass(frozen=True)
class LayeredCanvas:
    """A request's geometry: one layer's latent canvas, the layer count, the input image's packed latents
    ([1, tokens, channels]) and the transformer's layout: `layers + 1` one-frame grids, then the image's
    (diffusers' `img_shapes`, so each frame takes its own RoPE frame index)."""

    target: LatentCanvas
    layers: int
    references: torch.Tensor
    layout: ImageLayout


class QwenImageLayeredModel(AppendedImageSteps, QwenImageModel):
    """A Layered checkpoint's components on one device, with the shared pipeline's decomposition hooks."""

    components: LayeredComponents

    @classmethod
    def load(
        cls, directory: Path, dtype: torch.dtype, device: torch.device, vae_dtype: torch.dtype
    ) -> "QwenImageLayeredModel":
        return cls(load_layered_components(directory, dtype, device, vae_dtype), device, dtype)

    def default_size(self, images: list[PIL.Image.Image]) -> tuple[int, int]:
        """diffusers' 640 bucket at the image's aspect, each side a multiple of 32."""
        return calculate_dimensions(DEFAULT_RESOLUTION**2, images[0].width / images[0].height)

    def pixel_mode(self) -> str:
        """The PIL mode the VAE reads: RGBA for Layered's 4-channel VAE, else RGB."""
        return "RGBA" if self.components.vae.config.input_channels == 4 else "RGB"

    def canvas(
        self,
        width: int,
        height: int,
        images: list[PIL.Image.Image] | None = None,
        prompts: int = 1,
        layers: int = 1,
    ) -> LayeredCanvas:
        """The input image, in the VAE's mode, resized to `width` x `height` and encoded in the VAE's dtype
        (then the model's; diffusers runs both in one dtype), and the layout of `layers` layers."""
        if not images:
            raise InputError("Qwen-Image-Layered decomposes an input image: give one")
        vae = self.components.vae
        image = images[0].convert(self.pixel_mode())
        resized = self.image_processor.resize(image, height, width)
        pixels = self.image_processor.preprocess(resized, height, width).unsqueeze(2)
        condition, grids = encode_reference_latents(vae, [pixels], 1, self.device, vae.dtype)
        target = latent_size(width, height, self.vae_scale_factor)
        layout = ImageLayout(target.grid, (target.grid,) * layers + grids)
        return LayeredCanvas(target, layers, condition.to(self.dtype), layout)

    def caption(self, image: PIL.Image.Image, width: int, height: int, english: bool) -> str:
        """diffusers' caption of an empty prompt: the image in its mode, resized to the output size, shown to
        the text encoder with the instruction prompt."""
        resized = self.image_processor.resize(image.convert(self.pixel_mode()), height, width)
        c = self.components
        return caption_image(c.text_encoder, c.processor, resized, english, self.device)

    def sigmas(self, steps: int) -> np.ndarray:
        """From 1 down to 1/steps (diffusers' Layered default: `linspace(1, 0, steps + 1)[:-1]`)."""
        return np.linspace(1.0, 0, steps + 1)[:-1]

    def time_shift(self, canvas: LayeredCanvas) -> float:
        """`mu = sqrt(image tokens / 256)` from the input image's tokens, as diffusers' Layered sets it."""
        return (canvas.references.shape[1] / BASE_TOKENS) ** 0.5

    def initial_latents(self, canvas: LayeredCanvas, batch: int, seed: int) -> torch.Tensor:
        """[B, (layers + 1) * tokens, 4C]: one seeded draw of every frame, packed frame after frame."""
        target, frames = canvas.target, canvas.layers + 1
        shape = (batch, frames, self.components.latent_channels, target.height, target.width)
        generator = torch.Generator("cpu").manual_seed(seed)
        noise = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
        return pack_latents(noise.flatten(0, 1)).unflatten(0, (batch, frames)).flatten(1, 2)

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """`uncond + scale * (cond - uncond)`, not rescaled (diffusers' Layered `cfg_normalize=False`)."""
        return uncond + scale * (cond - uncond)

    def decode(self, latents: torch.Tensor, canvas: LayeredCanvas, fast: bool = False) -> Decoded:
        """Each row's layers (every frame but the first, the whole image) decoded as RGBA images, row after
        row, in one VAE batch."""
        vae, target, frames = self.components.vae, canvas.target, canvas.layers + 1
        tokens = latents.unflatten(1, (frames, -1))[:, 1:].flatten(0, 1)
        z = unpack_latents(tokens, target.height, target.width).to(vae.dtype)
        mean, inv_std = latent_statistics(vae, z.device, z.dtype)
        pixels, report = decode_frames(vae, z / inv_std + mean, fast)
        return Decoded(pil_images(self.image_processor, pixels), report)

    def describe(self) -> list[str]:
        return [
            *super().describe(),
            f"QwenImageLayeredPipeline: decomposes one {self.pixel_mode()} image into RGBA layers",
        ]
