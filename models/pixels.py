"""Decoded pixels to PIL images with the bytes of diffusers' `VaeImageProcessor.postprocess(..., "pil")`,
rounded to 8 bits on the pixels' device.

diffusers copies the denormalized pixels to the host as float32 and rounds there in numpy (`* 255`, `round`,
`astype(uint8)`): on a GPU host that is ~10 ms of CPU per 1024x1024 image after the decode. The same IEEE
float32 multiply and round-half-to-even on the device give the same levels and move a quarter of the bytes.
"""

import PIL.Image
import torch
from diffusers.image_processor import VaeImageProcessor


def pil_images(processor: VaeImageProcessor, pixels: torch.Tensor) -> list[PIL.Image.Image]:
    """`pixels` [B, C, H, W] as the VAE decodes them, as PIL images (L, RGB or RGBA by C)."""
    images = processor.postprocess(pixels, output_type="pt")  # denormalized as diffusers does it
    levels = (images.float() * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    if levels.shape[-1] == 1:
        return [PIL.Image.fromarray(image.squeeze(-1)) for image in levels]
    return [PIL.Image.fromarray(image) for image in levels]
