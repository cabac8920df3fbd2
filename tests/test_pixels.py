"""models/pixels.py: decoded pixels rounded to 8 bits on their device give the bytes of diffusers'
`VaeImageProcessor.postprocess(..., "pil")`, which rounds on the host in numpy."""

import pytest
import torch
from diffusers.image_processor import VaeImageProcessor

from qwen_image_fusion.models.pixels import pil_images


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", [1, 3, 4])
def test_pil_images_match_diffusers_postprocess(dtype: torch.dtype, channels: int) -> None:
    generator = torch.Generator().manual_seed(channels)
    pixels = (torch.rand(2, channels, 40, 24, generator=generator) * 2.6 - 1.3).to(dtype)  # some clamped
    halves = (torch.arange(256, dtype=torch.float32) + 0.5) / 255 * 2 - 1  # levels k + 0.5 before rounding
    pixels[0, 0, 0, :24] = halves[100:124].to(dtype)
    processor = VaeImageProcessor(vae_scale_factor=16)
    ours, theirs = pil_images(processor, pixels), processor.postprocess(pixels, output_type="pil")
    assert [(i.mode, i.size) for i in ours] == [(i.mode, i.size) for i in theirs]
    assert [i.tobytes() for i in ours] == [i.tobytes() for i in theirs]
    assert len({i.tobytes() for i in ours}) == 2
