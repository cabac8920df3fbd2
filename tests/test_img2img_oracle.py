"""img2img and inpainting in reference mode against diffusers' QwenImageImg2ImgPipeline and
QwenImageInpaintPipeline on the same weights: identical pixels, for several strengths, true CFG on and off,
two prompts and several images per prompt, on an image and a mask the project did not draw for itself (odd
sizes, resized to the request)."""

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline
from helpers import diffusers_twin

from qwen_image_fusion.pipelines import load_pipeline

STEPS = 5


@pytest.fixture(scope="module")
def pipes():
    ours = load_pipeline(variant="reference", device="cpu", dtype="fp32")
    classes = (QwenImageImg2ImgPipeline, QwenImageInpaintPipeline)
    return ours, {cls.__name__: diffusers_twin(ours, cls) for cls in classes}


def photo(width: int, height: int) -> PIL.Image.Image:
    """A smooth scene with noise: a sky ramp, a dark disc, grain."""
    y, x = np.mgrid[0:height, 0:width]
    sky = np.stack([90 + 120 * y / height, 140 + 60 * x / width, 230 - 80 * y / height], axis=-1)
    disc = ((x - 0.6 * width) ** 2 + (y - 0.4 * height) ** 2) < (0.2 * min(width, height)) ** 2
    sky[disc] = (40, 30, 20)
    grain = np.random.default_rng(5).normal(0, 10, sky.shape)
    return PIL.Image.fromarray(np.clip(sky + grain, 0, 255).astype(np.uint8), "RGB")


def ellipse_mask(width: int, height: int) -> PIL.Image.Image:
    """White inside an off-centre ellipse with soft grey edges (binarized at 0.5 by both pipelines)."""
    y, x = np.mgrid[0:height, 0:width]
    r = ((x - 0.35 * width) / (0.3 * width)) ** 2 + ((y - 0.55 * height) / (0.35 * height)) ** 2
    return PIL.Image.fromarray(np.clip(255 * (1.5 - r), 0, 255).astype(np.uint8), "L")


CASES = [
    ("a red fox in the snow", None, 0.6, 1),
    (["a cat", "一只熊猫在竹林里"], ["blurry", "low quality"], 0.8, 1),
    ("a lighthouse at dusk", "blurry", 1.0, 2),
    ("a boat", None, 0.35, 1),
]


@pytest.mark.parametrize("masked", [False, True], ids=["img2img", "inpaint"])
@pytest.mark.parametrize(("prompt", "negative", "strength", "per_prompt"), CASES)
def test_start_image_matches_diffusers_pixel_for_pixel(pipes, masked, prompt, negative, strength, per_prompt):
    ours, theirs = pipes
    width, height = 64, 48
    image = photo(71, 53)
    mask = ellipse_mask(71, 53) if masked else None
    scale = 1.0 if negative is None else 4.0
    kwargs = dict(width=width, height=height, num_inference_steps=STEPS, true_cfg_scale=scale)
    kwargs["strength"] = strength
    got = ours.generate(
        prompt,
        negative_prompt=negative,
        seed=7,
        num_images_per_prompt=per_prompt,
        init_image=image,
        mask_image=mask,
        **kwargs,
    )
    pipe = theirs["QwenImageInpaintPipeline" if masked else "QwenImageImg2ImgPipeline"]
    extra = {"mask_image": mask} if masked else {}
    expected = pipe(
        prompt=prompt,
        negative_prompt=negative,
        image=image,
        generator=torch.Generator("cpu").manual_seed(7),
        num_images_per_prompt=per_prompt,
        max_sequence_length=512,
        **extra,
        **kwargs,
    ).images
    assert len(got) == len(expected) == (1 if isinstance(prompt, str) else len(prompt)) * per_prompt
    for a, b in zip(got, expected, strict=True):
        assert a.size == (width, height)
        assert np.array_equal(np.asarray(a), np.asarray(b))
    plain = ours.generate(prompt, negative_prompt=negative, seed=7, **(kwargs | {"strength": None}))
    assert not np.array_equal(np.asarray(got[0]), np.asarray(plain[0]))  # the start image made a difference
