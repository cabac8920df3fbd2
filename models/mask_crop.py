"""`padding_mask_crop` as diffusers' Qwen-Image inpainting pipelines do it: a request is generated in the box
around its mask's white part (padded, widened to the output's aspect) at the output size, and the result is
pasted back into the image the box was cut from, only where the mask is white (`apply_overlay`). Helps when
the mask is small in a large image: the model spends its pixels on the part that changes."""

from dataclasses import dataclass

import PIL.Image
from diffusers.image_processor import VaeImageProcessor

Box = tuple[int, int, int, int]  # left, top, right, bottom in pixels of the image

_OVERLAY = VaeImageProcessor()  # diffusers' overlay resizes with the processor's default (LANCZOS)


@dataclass(frozen=True)
class MaskCrop:
    """The box a request is generated in, the image it is cut from and the result pasted onto, and the
    mask at that image's size."""

    image: PIL.Image.Image
    mask: PIL.Image.Image
    box: Box

    @classmethod
    def around(
        cls, image: PIL.Image.Image, mask: PIL.Image.Image, width: int, height: int, pad: int
    ) -> "MaskCrop":
        """The box of `mask`'s white part, `pad` pixels wider on each side (within the image), widened to
        the `width` x `height` output's aspect (diffusers' `VaeImageProcessor.get_crop_region`)."""
        return cls(image, mask, VaeImageProcessor.get_crop_region(mask, width, height, pad=pad))

    def paste(self, generated: PIL.Image.Image) -> PIL.Image.Image:
        """`generated` (the box, made at the output size) resized into the box of the image, which is kept
        where the mask is black: an image of the image's size."""
        return _OVERLAY.apply_overlay(self.mask, self.image, generated, self.box)
