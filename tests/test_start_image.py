"""Requests that start from an image (img2img) or repaint its masked part (inpainting), beyond the diffusers
oracle (tests/test_img2img_oracle.py): bad input refused in one line before anything runs, the default size
taken from the image, fused and unfused FP8 giving identical bytes (with a step cache too), a request alone
in a batch, a streamed memory plan giving the resident bytes, the plan counting the image's encoding."""

import dataclasses
import math

import numpy as np
import PIL.Image
import pytest
from helpers import png_sha256
from memory_fixtures import FP32, LateLink, placed_pipeline
from test_img2img_oracle import ellipse_mask, photo

from qwen_image_fusion.models.cache_presets import CachePreset
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.generation_request import resolve_request, start_size

IMAGE, MASK = photo(71, 53), ellipse_mask(71, 53)
REQUEST = dict(negative_prompt="blurry", width=64, height=48, num_inference_steps=6, seed=2)


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(variant="reference", device="cpu", dtype="fp32")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(strength=0.5), "strength needs the image it applies to"),
        (dict(mask_image=MASK), "mask_image needs the image it applies to"),
        (dict(init_image="photo.png"), "init_image is a str, not a PIL image"),
        (dict(init_image=IMAGE, mask_image=np.zeros((53, 71))), "mask_image is a ndarray"),
        (dict(init_image=IMAGE, strength=0), r"strength must be a number in \(0, 1\], got 0"),
        (dict(init_image=IMAGE, strength=1.5), "strength must be a number in"),
        (dict(init_image=IMAGE, strength=math.nan), "strength must be a number in"),
        (dict(init_image=IMAGE, strength="0.5"), "strength must be a number in"),
        (dict(init_image=IMAGE, strength=True), "strength must be a number in"),
        (dict(init_image=IMAGE, strength=1e-18), "leaves none of the 6 steps to run"),
        (dict(init_image=IMAGE, mask_image=ellipse_mask(70, 53)), "mask_image is 70x53 but init_image is 71"),
    ],
)
def test_bad_start_values_are_refused_in_one_line(pipe, values, message):
    with pytest.raises(InputError, match=message):
        resolve_request(pipe.spec, "a fox", num_inference_steps=6, **values)


def test_a_model_that_does_not_start_from_images_refuses_one(pipe):
    spec = dataclasses.replace(pipe.spec, starts_from_image=False)
    with pytest.raises(InputError, match="does not start from an image: img2img and inpainting run on"):
        resolve_request(spec, "a fox", init_image=IMAGE)


def test_the_size_comes_from_the_start_image(pipe):
    """Sides rounded down to the size multiple; a larger image scaled down to the default area."""
    spec = pipe.spec
    request = resolve_request(spec, "a fox", init_image=IMAGE)
    assert (request.width, request.height) == (64, 48) and request.start.strength == 0.6
    big = PIL.Image.new("RGB", (3000, 1000))
    width, height = start_size(big, spec)
    assert width % spec.size_multiple == height % spec.size_multiple == 0
    assert width * height <= spec.defaults.width * spec.defaults.height and 2.5 < width / height < 3.5
    assert resolve_request(spec, "a fox", init_image=IMAGE, width=32, height=32).width == 32


def test_steps_run_follow_the_strength(pipe):
    request = resolve_request(pipe.spec, "a fox", init_image=IMAGE, strength=0.5, num_inference_steps=10)
    steps = []
    pipe.run([request], on_step=lambda i, n: steps.append((i, n)))
    assert request.steps_run == 5 and steps == [(i, 5) for i in range(1, 6)]


@pytest.mark.parametrize("masked", [False, True], ids=["img2img", "inpaint"])
def test_fused_and_unfused_fp8_give_the_same_bytes(fp8_dir, masked):
    """With a step cache skipping steps too: the same steps are skipped in both."""
    pipe = load_pipeline(fp8_dir, variant="fp8-fused", device="cpu", dtype="bf16")
    always = CachePreset("always", threshold=math.inf, warmup_steps=2, max_cached_in_a_row=2)
    start = dict(init_image=IMAGE, mask_image=MASK if masked else None, strength=0.7)  # 5 of 6 steps run
    runs = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        plain = png_sha256(pipe.generate("a fox", **REQUEST, **start)[0])
        cached = png_sha256(pipe.generate("a fox", **REQUEST, **start, cache=always)[0])
        runs[variant] = (plain, cached, pipe.last_run.cache)
    assert runs["fp8-fused"] == runs["fp8-unfused"] and runs["fp8-fused"][0] != runs["fp8-fused"][1]
    assert runs["fp8-fused"][2].skipped == {"positive": (2,), "negative": (2,)}


def test_a_start_image_request_runs_alone(pipe):
    """Its own latents and (inpainting) its mask: it never shares denoising steps with another request."""
    start = pipe.request("a fox", **REQUEST, init_image=IMAGE, mask_image=MASK)
    assert start.batch_key is None and pipe.request("a fox", **REQUEST).batch_key is not None
    with pytest.raises(InputError, match="requests that share a batch must agree"):
        pipe.run([start, start], slots=2)


def test_a_streamed_plan_gives_the_resident_bytes(pipe):
    request = dict(REQUEST, init_image=IMAGE, mask_image=MASK, strength=0.8)
    placed = placed_pipeline(None, "reference", ("offload", 1), 2, LateLink(), precision=FP32)
    expected = png_sha256(pipe.generate("a fox", **request)[0])
    assert png_sha256(placed.generate("a fox", **request)[0]) == expected


def test_the_plan_counts_encoding_the_start_image(pipe):
    planned = load_pipeline(variant="reference", device="cpu", dtype="fp32", gpu_memory="1GiB")
    activations = planned.memory.profile.activations
    workload = Workload(1024, 1024, start_image=True)
    decode = activations.decode(dataclasses.replace(workload, start_image=False), tiled=True)
    assert activations.decode(workload, tiled=True) > decode
    assert planned.request("a fox", init_image=IMAGE).workload().start_image
