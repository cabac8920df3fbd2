"""Editing end to end in reference mode against diffusers' own `QwenImageEditPipeline` and
`QwenImageEditPlusPipeline` on tiny checkpoints they load with `from_pretrained`: our
`load_pipeline(dir, variant="reference", dtype=...)` + `pipe.generate(prompt, image=...)` gives the same PNG
bytes for one image (Edit and Plus), two and three images (Plus), `zero_cond_t` on (Edit-2511) and off
(Edit-2509), true CFG on and off, odd aspect ratios, RGBA and palette inputs, several images per prompt and
a prompt batch (Edit; diffusers' Plus takes one prompt per call). The output size an image suggests is
diffusers' own, and a request the model cannot serve is refused in one line."""

from dataclasses import dataclass
from pathlib import Path

import PIL.Image
import pytest
import torch
from edit_fixtures import (
    build_edit_checkpoints,
    diffusers_edit,
    diffusers_edit_pipeline,
    drawn_image,
    our_edit_pipeline,
)
from helpers import png_sha256

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.qwen_image_edit.conditioning import load_edit_image

pytestmark = pytest.mark.slow
SEEDS = {"edit": 1, "plus-2511": 2, "plus-2509": 3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_edit_checkpoints(tmp_path_factory.mktemp("edit-oracle"), SEEDS)


class Loaded(dict):
    """Pipelines by (checkpoint name, dtype), loaded on first use by `load(directory, dtype)`."""

    def __init__(self, checkpoints: dict[str, Path], load) -> None:
        super().__init__()
        self.checkpoints, self.load = checkpoints, load

    def __missing__(self, key: tuple[str, torch.dtype]):
        self[key] = self.load(self.checkpoints[key[0]], key[1])
        return self[key]


@pytest.fixture(scope="module")
def ours(checkpoints) -> Loaded:
    return Loaded(checkpoints, our_edit_pipeline)


@pytest.fixture(scope="module")
def theirs(checkpoints) -> Loaded:
    return Loaded(checkpoints, diffusers_edit_pipeline)


@dataclass(frozen=True)
class Case:
    checkpoint: str
    images: tuple[tuple[int, int, int, str], ...]  # drawn_image(width, height, seed, mode)
    prompts: tuple[str, ...]
    negative: str | None
    size: tuple[int, int]
    dtype: torch.dtype = torch.float32
    per_prompt: int = 1


CASES = {
    "edit, odd image, true CFG": Case("edit", ((75, 53, 1, "RGB"),), ("make the sky red",), " ", (48, 32)),
    "edit, RGBA, CFG off, bf16, two per prompt": Case(
        "edit", ((61, 90, 2, "RGBA"),), ("一只猫",), None, (32, 48), torch.bfloat16, per_prompt=2
    ),
    "edit, prompt batch, true CFG": Case(
        "edit", ((96, 96, 3, "RGB"),), ("paint it blue", "add a small yellow star at the top left"), "blurry",
        (32, 32),
    ),
    "plus 2511, one image, true CFG": Case("plus-2511", ((83, 47, 4, "RGB"),), ("add a hat",), " ", (48, 32)),
    "plus 2511, two images, palette": Case(
        "plus-2511", ((50, 70, 5, "P"), (99, 41, 6, "RGB")), ("put 1 beside 2",), "low quality", (64, 32)
    ),
    "plus 2511, three images, RGBA, bf16": Case(
        "plus-2511",
        ((40, 40, 7, "RGBA"), (77, 51, 8, "RGB"), (33, 95, 9, "P")),
        ("the cat from picture 1 sits on the sofa of picture 2 under the lamp of picture 3",),
        " ",
        (32, 32),
        torch.bfloat16,
    ),
    "plus 2509, two images, CFG off": Case(
        "plus-2509", ((64, 48, 10, "RGB"), (48, 64, 11, "RGBA")), ("swap them",), None, (48, 48)
    ),
    "plus 2509, tall image, true CFG, two per prompt": Case(
        "plus-2509", ((33, 95, 12, "RGB"),), ("make it night",), " ", (32, 64), per_prompt=2
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_pixels_equal_diffusers(ours, theirs, name: str) -> None:
    case = CASES[name]
    images = [drawn_image(*spec) for spec in case.images]
    width, height = case.size
    got = ours[(case.checkpoint, case.dtype)].generate(
        list(case.prompts) if len(case.prompts) > 1 else case.prompts[0],
        image=images,
        negative_prompt=case.negative,
        true_cfg_scale=4.0,
        width=width,
        height=height,
        num_inference_steps=2,
        num_images_per_prompt=case.per_prompt,
        seed=0,
    )
    expected = diffusers_edit(
        theirs[(case.checkpoint, case.dtype)], list(case.prompts), images, case.negative, case.size,
        per_prompt=case.per_prompt,
    )  # fmt: skip
    assert len(got) == len(expected) == len(case.prompts) * case.per_prompt
    assert [png_sha256(image) for image in got] == [png_sha256(image) for image in expected]
    assert all(image.size == case.size for image in got)
    assert len({png_sha256(image) for image in got}) == len(got), "each image must differ"


class Computed(Exception):
    """Raised by a patched `check_inputs` with the size diffusers' pipeline computed."""


def diffusers_default_size(pipe, image) -> tuple[int, int]:
    """(width, height) diffusers' pipeline picks for `image` when none is given: read from its
    `check_inputs(prompt, height, width, ...)` call, which comes before any model runs."""

    def record(prompt, height, width, **_kwargs):
        raise Computed(width, height)

    pipe.check_inputs = record
    try:
        pipe(image=image, prompt="x")
    except Computed as size:
        return size.args
    finally:
        del pipe.check_inputs
    raise AssertionError("diffusers never checked its inputs")


def exif_rotated(image: PIL.Image.Image, tmp_path: Path) -> PIL.Image.Image:
    """`image` saved with EXIF orientation 6 (displayed rotated by 90 degrees) and opened again."""
    exif = image.getexif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.png"
    image.save(path, exif=exif)
    return PIL.Image.open(path)


@pytest.mark.parametrize("checkpoint", ["edit", "plus-2511"])
def test_default_output_size_is_diffusers(ours, theirs, checkpoint: str, tmp_path: Path) -> None:
    """The images' suggested size (first image for Edit, last for Plus; EXIF rotation applied as
    diffusers' `load_image` applies it) equals what diffusers' pipeline computes from the same images."""
    model = ours[(checkpoint, torch.float32)].model
    pipe = theirs[(checkpoint, torch.float32)]
    plus = model.kind.plus
    sets = [
        [drawn_image(300, 100, 1)],
        [drawn_image(1000, 1700, 2)],
        [exif_rotated(drawn_image(640, 360, 3), tmp_path)],
    ]
    if plus:
        sets.append([drawn_image(300, 100, 4), drawn_image(50, 77, 5)])
    for images in sets:
        rgb = [load_edit_image(image) for image in images]
        expected = diffusers_default_size(pipe, rgb if plus else rgb[0])
        assert model.default_size(images) == expected


def test_one_side_given_takes_the_other_from_the_image(ours) -> None:
    """diffusers' `height = height or calculated_height`: each side not given follows the image."""
    pipe = ours[("plus-2509", torch.float32)]
    image = drawn_image(40, 20, 1)
    pipe.generate("x", image=image, width=64, num_inference_steps=2, seed=0)
    suggested = pipe.model.default_size([image])
    # 2:1 at 1024x1024 pixels: width sqrt(2) * 1024 = 1448.2 -> 45 x 32, height 724.1 -> 23 x 32
    assert suggested == (1440, 736)
    assert (pipe.last_run.width, pipe.last_run.height) == (64, 736)


def test_requests_the_model_cannot_serve_are_refused(ours) -> None:
    edit, plus = ours[("edit", torch.float32)], ours[("plus-2511", torch.float32)]
    image = drawn_image(32, 32, 1)
    with pytest.raises(InputError, match="works on input images: give at least one input image"):
        edit.generate("x", num_inference_steps=2)
    with pytest.raises(InputError, match=r"2 input images, but .* takes at most 1"):
        edit.generate("x", image=[image, image], num_inference_steps=2)
    with pytest.raises(InputError, match=r"4 input images, but .* takes at most 3"):
        plus.generate("x", image=[image] * 4, num_inference_steps=2)
    with pytest.raises(InputError, match="one prompt per call"):
        plus.generate(["x", "y"], image=image, num_inference_steps=2)
    with pytest.raises(InputError, match="input image 1 is a str"):
        plus.generate("x", image="photo.png", num_inference_steps=2)
