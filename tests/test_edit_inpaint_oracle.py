"""Inpainting edits in reference mode against diffusers' own `QwenImageEditInpaintPipeline` on a tiny Edit
checkpoint (`QwenImageEditPipeline`; diffusers has no Plus inpainting): `generate(prompt, image=, mask_image=,
strength=)` gives diffusers' PNG bytes for true CFG on and off, several strengths (and diffusers' default when
none is given), two images per prompt, FP32 and BF16, and `padding_mask_crop`, whose box diffusers cuts from
the image resized to the output size. Also: `padding_mask_crop` on Qwen-Image inpainting equals diffusers'
`QwenImageInpaintPipeline`, and bad inpainting requests are refused in one line before anything runs."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import QwenImageEditInpaintPipeline, QwenImageInpaintPipeline
from edit_fixtures import (
    build_edit_checkpoints,
    diffusers_edit_pipeline,
    drawn_image,
    our_inpaint_pipeline,
    small_edit_areas,
)
from helpers import diffusers_twin, png_sha256
from test_img2img_oracle import ellipse_mask, photo

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.generation_request import resolve_request

pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_edit_checkpoints(tmp_path_factory.mktemp("edit-inpaint"), {"edit": 4, "plus-2509": 5})


@pytest.fixture(scope="module")
def pipes(checkpoints):
    """Ours and diffusers' inpainting pipeline on the Edit checkpoint, by dtype (loaded on first use)."""
    loaded = {}

    def get(dtype: torch.dtype):
        if dtype not in loaded:
            # its components as loaded (`from_pipe` would cast them all to FP32 or to one dtype)
            theirs = QwenImageEditInpaintPipeline(
                **diffusers_edit_pipeline(checkpoints["edit"], dtype).components
            )
            theirs.set_progress_bar_config(disable=True)
            loaded[dtype] = our_inpaint_pipeline(checkpoints["edit"], dtype), theirs
        return loaded[dtype]

    return get


@dataclass(frozen=True)
class Case:
    image: tuple[int, int, int]  # drawn_image(width, height, seed)
    negative: str | None
    strength: float | None  # None: each pipeline's default
    per_prompt: int = 1
    crop: int | None = None
    dtype: torch.dtype = torch.float32


CASES = {
    "odd image, true CFG, default strength": Case((75, 53, 1), "blurry", None),
    "CFG off, strength 0.9, two per prompt": Case((61, 90, 2), None, 0.9, per_prompt=2),
    "true CFG, strength 0.5, bf16": Case((90, 61, 3), " ", 0.5, dtype=torch.bfloat16),
    "crop, image at its output size, true CFG": Case((128, 64, 4), "blurry", 0.8, crop=4),
    "crop, no padding, CFG off, two per prompt": Case((96, 96, 5), None, 1.0, per_prompt=2, crop=0),
}


def diffusers_inpaint(theirs, prompt: str, image, mask, case: Case) -> list[PIL.Image.Image]:
    extra = {} if case.strength is None else {"strength": case.strength}
    with small_edit_areas():
        return theirs(
            image=image,
            prompt=prompt,
            negative_prompt=case.negative,
            mask_image=mask,
            true_cfg_scale=4.0,
            num_inference_steps=STEPS,
            num_images_per_prompt=case.per_prompt,
            padding_mask_crop=case.crop,
            generator=torch.Generator().manual_seed(3),
            **extra,
        ).images


@pytest.mark.parametrize("name", list(CASES))
def test_inpainting_edit_equals_diffusers(pipes, name: str) -> None:
    case = CASES[name]
    ours, theirs = pipes(case.dtype)
    image = drawn_image(*case.image)
    mask = ellipse_mask(*image.size)
    prompt = "paint a red ball"
    got = ours.generate(
        prompt,
        image=image,
        mask_image=mask,
        strength=case.strength,
        padding_mask_crop=case.crop,
        negative_prompt=case.negative,
        true_cfg_scale=4.0,
        num_inference_steps=STEPS,
        num_images_per_prompt=case.per_prompt,
        seed=3,
    )
    expected = diffusers_inpaint(theirs, prompt, image, mask, case)
    assert len(got) == len(expected) == case.per_prompt
    assert [png_sha256(i) for i in got] == [png_sha256(i) for i in expected]
    assert all(i.size == ours.model.default_size([image]) for i in got)
    assert ours.last_run.num_inference_steps == STEPS - int(STEPS - STEPS * (case.strength or 0.6))
    plain = ours.generate(
        prompt, image=image, negative_prompt=case.negative, num_inference_steps=STEPS, seed=3
    )
    assert png_sha256(plain[0]) != png_sha256(got[0])  # the mask and the start made a difference


def test_crop_of_an_image_at_another_size_than_its_output(pipes) -> None:
    """diffusers cuts the box from the image resized to the output size, but finds it in the mask as given,
    and fails to paste back unless that is the output size too; ours resizes the mask with the image: the
    edit has the output size and keeps the resized image exactly where the resized mask is black."""
    ours, theirs = pipes(torch.float32)
    image, mask = drawn_image(75, 53, 6), ellipse_mask(75, 53)
    case = Case((75, 53, 6), "blurry", 0.7, crop=2)
    with pytest.raises(ValueError, match="images do not match"):
        diffusers_inpaint(theirs, "a boat", image, mask, case)
    got = ours.generate(
        "a boat", image=image, mask_image=mask, strength=0.7, padding_mask_crop=2, negative_prompt="blurry",
        num_inference_steps=STEPS, seed=3,
    )[0]  # fmt: skip
    width, height = ours.model.default_size([image])
    resized = [np.asarray(ours.model.image_processor.resize(i, height, width)) for i in (image, mask)]
    kept = resized[1] == 0
    assert got.size == (width, height) and kept.any() and not kept.all()
    assert np.array_equal(np.asarray(got)[kept], resized[0][kept])
    assert not np.array_equal(np.asarray(got)[~kept], resized[0][~kept])


@pytest.mark.parametrize("crop", [0, 6])
def test_qwen_image_inpainting_crop_equals_diffusers(crop: int) -> None:
    """`QwenImageInpaintPipeline(padding_mask_crop=)`: the box is generated at 64x48 and pasted back into
    the 71x53 start image, which is what comes back."""
    ours = load_pipeline(variant="reference", device="cpu", dtype="fp32")
    theirs = diffusers_twin(ours, QwenImageInpaintPipeline)
    image, mask = photo(71, 53), ellipse_mask(71, 53)
    kwargs = dict(width=64, height=48, num_inference_steps=STEPS, true_cfg_scale=4.0, strength=0.9)
    got = ours.generate(
        "a fox", negative_prompt="blurry", seed=7, init_image=image, mask_image=mask, padding_mask_crop=crop,
        **kwargs,
    )  # fmt: skip
    expected = theirs(
        prompt="a fox", negative_prompt="blurry", image=image, mask_image=mask, padding_mask_crop=crop,
        generator=torch.Generator("cpu").manual_seed(7), **kwargs,
    ).images  # fmt: skip
    assert png_sha256(got[0]) == png_sha256(expected[0]) and got[0].size == image.size
    whole = ours.generate(
        "a fox", negative_prompt="blurry", seed=7, init_image=image, mask_image=mask, **kwargs
    )
    assert png_sha256(whole[0]) != png_sha256(got[0])


def test_bad_inpainting_requests_are_refused_in_one_line(pipes, checkpoints) -> None:
    ours, _ = pipes(torch.float32)
    edit = ours.spec
    plus = load_pipeline(checkpoints["plus-2509"], variant="reference", device="cpu", dtype="fp32").spec
    image, mask = drawn_image(40, 30, 1), ellipse_mask(40, 30)
    refused = [
        (edit, dict(mask_image=ellipse_mask(30, 40)), "mask_image is 30x40 but the input image is 40x30"),
        (edit, dict(strength=0.5), "strength needs mask_image"),
        (edit, dict(padding_mask_crop=8), "padding_mask_crop needs mask_image"),
        (edit, dict(mask_image=mask, padding_mask_crop=-1), "padding_mask_crop must be a whole number"),
        (edit, dict(mask_image=mask, padding_mask_crop=2.5), "padding_mask_crop must be a whole number"),
        (edit, dict(mask_image=PIL.Image.new("L", (40, 30)), padding_mask_crop=0), "mask_image is all black"),
        (edit, dict(init_image=image, mask_image=mask), "init_image: .* inpaints its input image"),
        (edit, dict(mask_image=mask, width=64), "width and height: an inpainting edit is made at the size"),
        (edit, dict(mask_image=mask, prompt=["a", "b"]), "prompt: an inpainting edit takes one prompt"),
        (edit, dict(mask_image=mask, strength=0), r"strength must be a number in \(0, 1\]"),
        (plus, dict(mask_image=mask), "mask_image: .* neither inpaints nor starts from an image"),
    ]
    for spec, values, message in refused:
        values = {"prompt": "x", "image": image} | values
        with pytest.raises(InputError, match=message) as caught:
            resolve_request(spec, **values)
        assert "\n" not in str(caught.value)
    request = resolve_request(edit, "x", image=image, mask_image=mask)
    assert request.start.image is image and request.start.strength == 0.6  # diffusers' default
    assert resolve_request(edit, "x", image=image).start is None  # an edit without a mask: a plain edit
