"""Edit reference mode against diffusers as a user calls it: diffusers' own `QwenImageEditPlusPipeline`,
unpatched (its fixed 1024x1024 VAE and 384x384 vision-tower image areas), given the PIL images opened from
the files, against `qwen-image edit --variant reference` on the same files. A tiny random Edit-2511
checkpoint (`zero_cond_t`) built with diffusers' classes; 3 steps, true CFG; the same PNG bytes.

The other oracle tests shrink diffusers' image areas and convert the images with our loader first (to run
in seconds); this one leaves diffusers as it ships. diffusers gets the processor our loader builds from the
checkpoint (transformers cannot build `Qwen2VLProcessor` without torchvision: docs/DESIGN.md §8)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from edit_fixtures import build_edit_checkpoint, drawn_image
from helpers import REPO

from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.qwen_image_edit.conditioning import load_processor
from qwen_image_fusion.pipelines.precision import pick_numerics

pytestmark = pytest.mark.slow
PROMPT, NEGATIVE, SEED = "make the sky red", " ", 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Edit-2511 checkpoint whose VAE is of base width 2: it runs at diffusers' full 1024x1024 area,
    which does not depend on the VAE's width."""
    directory = tmp_path_factory.mktemp("edit-2511")
    return build_edit_checkpoint(directory, "QwenImageEditPlusPipeline", True, 4, vae_base_dim=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A landscape PNG and a portrait JPEG, as a user's files might be."""
    root = tmp_path_factory.mktemp("inputs")
    paths = [root / "wide.png", root / "tall.jpg"]
    drawn_image(120, 80, 1).save(paths[0])
    drawn_image(70, 110, 2).save(paths[1], quality=90)
    return paths


def ours(
    checkpoint: Path, files: list[Path], size: tuple[int, int], out: Path, dtype: str | None
) -> np.ndarray:
    command = [
        sys.executable,
        "-m",
        "qwen_image_fusion.ui.cli",
        "edit",
        PROMPT,
        "--model",
        str(checkpoint),
        "-o",
        str(out),
    ]
    command += ["--variant", "reference", "--device", "cpu", "--steps", "3", "--seed", str(SEED)]
    command += ["--width", str(size[0]), "--height", str(size[1]), "--negative-prompt", NEGATIVE]
    command += ["--true-cfg-scale", "4"] + (["--dtype", dtype] if dtype else [])
    for path in files:
        command += ["--image", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return np.asarray(PIL.Image.open(out))


def theirs(checkpoint: Path, files: list[Path], size: tuple[int, int], dtype: torch.dtype) -> np.ndarray:
    pipe = QwenImageEditPlusPipeline.from_pretrained(
        checkpoint, processor=load_processor(checkpoint / "processor"), dtype=dtype
    )
    pipe.set_progress_bar_config(disable=True)
    images = [PIL.Image.open(path) for path in files]
    image = pipe(
        image=images if len(images) > 1 else images[0],
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        true_cfg_scale=4.0,
        width=size[0],
        height=size[1],
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(SEED),
    ).images[0]
    return np.asarray(image)


def assert_equal_pixels(got: np.ndarray, expected: np.ndarray, size: tuple[int, int]) -> None:
    assert got.shape == expected.shape == (size[1], size[0], 3)
    assert np.array_equal(got, expected), f"{int((got != expected).sum())} of {got.size} values differ"


def test_one_image_in_fp32_equals_unpatched_diffusers(checkpoint, files, tmp_path):
    """FP32 on every CPU kind. BF16 against unpatched diffusers is the next test's on a CPU whose default it
    is, and on the other kind in `.ci/run`'s pass with the other default forced (BF16 without native support
    took 200 s here for one image: diffusers' fixed 1024x1024 VAE area)."""
    size = (96, 64)
    got = ours(checkpoint, files[:1], size, tmp_path / "ours.png", "fp32")
    assert_equal_pixels(got, theirs(checkpoint, files[:1], size, torch.float32), size)


@pytest.mark.cpu_dtype
def test_two_images_in_the_default_dtype_equal_unpatched_diffusers_in_that_dtype(checkpoint, files, tmp_path):
    """Without --dtype our pipeline picks the CPU's default (BF16 or FP32): diffusers in the same dtype."""
    size = (64, 96)
    _, precision = pick_numerics(WeightFormat.BF16, "reference", torch.device("cpu"))
    got = ours(checkpoint, files, size, tmp_path / "ours.png", None)
    assert_equal_pixels(got, theirs(checkpoint, files, size, precision.dtype), size)
