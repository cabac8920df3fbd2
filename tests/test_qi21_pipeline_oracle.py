"""The Qwen-Image 2.1 pipeline in reference mode against diffusers' `QwenImage21Pipeline` on the same tiny
checkpoint (tests/qi21_checkpoints.py): identical PNG bytes for text to image, one and two condition images,
the KV cache on and off (each against diffusers with the same `use_kv_cache`), true CFG on and off, a padded
prompt batch with several images per prompt, the Turbo checkpoint's sampling grid, and a transformer
without `causal_condition` (no cache to use)."""

import numpy as np
import pytest
import torch
from edit_fixtures import drawn_image
from helpers import png_sha256
from qi21_checkpoints import RESOLUTION, TURBO_SIGMAS, build_qi21_checkpoint, diffusers_pipeline

from qwen_image_fusion.pipelines import load_pipeline

FOX, BLUE = "a red fox in the snow", "make the sky blue and add a small boat"
RGBA = drawn_image(160, 64, seed=1, mode="RGBA")  # wide, with a varying alpha: the VAE reads it
PORTRAIT = drawn_image(48, 112, seed=2)


def pipelines(directory):
    ours = load_pipeline(directory, variant="reference", device="cpu", dtype="fp32")
    ours.model.resolution = RESOLUTION
    return ours, diffusers_pipeline(directory)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return pipelines(build_qi21_checkpoint(tmp_path_factory.mktemp("qi21") / "base"))


def generate_both(ours, theirs, prompt, kv_cache=True, **kwargs):
    """(ours, diffusers') images for one request; a `seed` in kwargs is diffusers' CPU generator."""
    seed = kwargs.pop("seed", 3)
    ours.model.use_kv_cache = kv_cache
    got = ours.generate(prompt, seed=seed, **kwargs)
    generator = torch.Generator("cpu").manual_seed(seed)
    want = theirs(
        prompt, generator=generator, use_kv_cache=kv_cache, output_resolution=RESOLUTION, **kwargs
    ).images
    return got, want


def assert_same_pngs(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.size == b.size and a.mode == b.mode
        differ = int(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max())
        assert png_sha256(a) == png_sha256(b), f"max pixel difference {differ}"


CASES = {
    "text to image, cache": dict(prompt=FOX, width=96, height=64),
    "text to image, no cache": dict(prompt=FOX, width=96, height=64, kv_cache=False),
    "one RGBA condition image, cache": dict(prompt=BLUE, image=RGBA),
    "one RGBA condition image, no cache": dict(prompt=BLUE, image=RGBA, kv_cache=False),
    "two condition images, true CFG, cache": dict(
        prompt=BLUE, image=[RGBA, PORTRAIT], negative_prompt="blurry", true_cfg_scale=3.0
    ),
    "two condition images, true CFG, no cache": dict(
        prompt=BLUE, image=[PORTRAIT, RGBA], negative_prompt="blurry", true_cfg_scale=3.0, kv_cache=False
    ),
    "true CFG, a negative prompt of the prompt's length (two slots of one shape), cache": dict(
        prompt=FOX, negative_prompt="a blue fox in the snow", true_cfg_scale=4.0, width=64, height=64
    ),
    "padded prompt batch, 2 per prompt, true CFG, cache": dict(
        prompt=["a cat", "a much longer prompt about a small dog on a sofa"],
        negative_prompt=["low quality", ""],
        true_cfg_scale=4.0,
        num_images_per_prompt=2,
        width=64,
        height=96,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_pipeline_matches_diffusers_png_for_png(base, case):
    kwargs = dict(CASES[case])
    got, want = generate_both(*base, num_inference_steps=3, **kwargs)
    assert_same_pngs(got, want)
    if kwargs.get("image") is not None:  # the output takes the last condition image's aspect
        last = kwargs["image"][-1] if isinstance(kwargs["image"], list) else kwargs["image"]
        assert (got[0].width > got[0].height) == (last.width > last.height)


def test_cases_are_not_trivial(base):
    """The condition image, the prompt and the seed each change the pixels (so equal PNGs above mean
    something)."""
    ours, _ = base
    ours.model.use_kv_cache = True
    args = dict(num_inference_steps=2, seed=3)
    first = png_sha256(ours.generate(BLUE, image=RGBA, **args)[0])
    assert first != png_sha256(ours.generate(BLUE, image=RGBA.rotate(180), **args)[0])
    assert first != png_sha256(ours.generate(FOX, image=RGBA, **args)[0])
    assert first != png_sha256(ours.generate(BLUE, image=RGBA, num_inference_steps=2, seed=4)[0])


def test_turbo_checkpoint_samples_its_own_grid(tmp_path):
    """`sample_sigmas` in model_index.json: the default steps are its length and the grid is its sigmas,
    as diffusers uses them; another step count samples linspace(1, 1/N) as the base model."""
    ours, theirs = pipelines(build_qi21_checkpoint(tmp_path / "turbo", seed=4, sample_sigmas=TURBO_SIGMAS))
    assert ours.defaults.num_inference_steps == len(TURBO_SIGMAS)
    got, want = generate_both(ours, theirs, FOX, width=64, height=64)
    assert_same_pngs(got, want)
    assert ours.last_run.num_inference_steps == len(TURBO_SIGMAS)
    assert np.allclose(ours.model.sigmas(len(TURBO_SIGMAS)), TURBO_SIGMAS)
    assert np.allclose(ours.model.sigmas(5), np.linspace(1, 0.2, 5))


def test_without_causal_condition_every_step_is_the_full_pass(tmp_path):
    ours, theirs = pipelines(build_qi21_checkpoint(tmp_path / "plain", seed=6, causal_condition=False))
    got, want = generate_both(ours, theirs, BLUE, image=RGBA, num_inference_steps=3)
    assert_same_pngs(got, want)
    assert not ours.model.planner.slots, "a transformer without causal_condition has no prefix to cache"


def test_bf16_reference_matches_diffusers_loaded_in_bf16(tmp_path):
    """In BF16 (diffusers' `from_pretrained(dtype=torch.bfloat16)`: its timestep frequencies stay FP32)."""
    directory = build_qi21_checkpoint(tmp_path / "bf16", seed=2)
    ours = load_pipeline(directory, variant="reference", device="cpu", dtype="bf16")
    ours.model.resolution = RESOLUTION
    theirs = diffusers_pipeline(directory, torch.bfloat16)
    got, want = generate_both(ours, theirs, BLUE, image=RGBA, negative_prompt="blurry", true_cfg_scale=3.0,
                              num_inference_steps=3)  # fmt: skip
    assert_same_pngs(got, want)
