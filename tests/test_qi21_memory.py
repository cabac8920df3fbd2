"""GPU-memory plans for Qwen-Image 2.1: the prefix KV cache held per CFG branch (counted in every phase, at
most one per branch kept under a plan), the full pass and the cached step as activations, the plans of the
released sizes at 16 and 24 GiB, and 2.1 requests under streaming placements giving the resident bytes, the
cached steps included (they skip the transformer's `forward`, so streaming follows the blocks), on the CPU
standing in for the device."""

import math
from dataclasses import replace

import pytest
from diffusers import AutoencoderKLQwenImage21
from edit_fixtures import drawn_image
from helpers import png_sha256
from memory_fixtures import FP32, LateLink, placed_pipeline
from qi21_checkpoints import RESOLUTION, build_qi21_checkpoint
from transformers import Qwen3VLForConditionalGeneration

from bench.activation_memory import (
    decode_peak,
    encode_peak,
    qi21_transformer_peak,
    qi21_vision_peak,
    text_encoder_peak,
)
from bench.header_checkpoint import qi21_header_checkpoint
from qwen_image_fusion.models.cache_presets import CachePreset
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.family import DEFAULT_SEQUENCE_LENGTH
from qwen_image_fusion.models.memory import DECODE, ENCODE, Workload
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image21.memory import VISION_BYTES_PER_WIDTH
from qwen_image_fusion.models.qwen_image21.synthetic import (
    QWEN3_VL_8B_TEXT,
    QWEN3_VL_8B_VISION,
    text_encoder_config,
)
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.memory_plan import (
    RESIDENT,
    STREAM,
    GiB,
    default_workload,
    minimum_budget,
    phase_peaks,
    plan_memory,
)
from qwen_image_fusion.ui.cli import main

PROMPT = "a red fox in the snow"
CFG = dict(negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=3, seed=7)


@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    """The released 2.1's sizes (FP8 transformer, Qwen3-VL-8B with its vision tower), headers only."""
    directory = qi21_header_checkpoint(tmp_path_factory.mktemp("qi21-fp8"))
    spec = inspect_checkpoint(directory)
    return spec, spec.family.memory_profile(spec, 2, 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Four blocks: more than the two slots they stream through, so each call must load its own."""
    return build_qi21_checkpoint(tmp_path_factory.mktemp("qi21-memory") / "ckpt", num_layers=4)


def test_the_kv_cache_is_held_per_branch_and_counted_in_every_phase(full_size):
    spec, profile = full_size
    act = profile.activations
    one, cfg = Workload(1024, 1024, true_cfg=False), Workload(1024, 1024)
    sequence = act.sequence(cfg)
    assert sequence >= 1024 + 4096 and act.held(cfg) == 2 * act.held(one) == 2 * 32 * 2 * sequence * 4096 * 2
    assert act.held(Workload(1024, 1024, input_images=1)) > act.held(cfg)
    assert act.first_step(cfg) > act.step(cfg)  # the full pass over the prefix, then target rows only
    no_cache = replace(act, kv_cache=False)
    assert no_cache.held(cfg) == 0 and no_cache.step(cfg) == no_cache.first_step(cfg) > act.step(cfg)
    placements = plan_memory(profile, 48 * GiB, cfg).placements
    held = phase_peaks(profile, placements, cfg, tiled=False, graphs=False)
    none = phase_peaks(replace(profile, activations=no_cache), placements, cfg, tiled=False, graphs=False)
    assert held[ENCODE] - none[ENCODE] == held[DECODE] - none[DECODE] == act.held(cfg)
    assert default_workload(spec).input_images == 0 and spec.max_images == 4  # condition images: optional


def test_activation_estimates_bound_what_traces_allocate(full_size):
    """At full width, within 30%: the full pass with a condition image and the cached step (fake tensors,
    one block: a step's peak is one block's), the pass without a cache, a text-only prompt in Qwen3-VL-8B,
    the VAE's whole decode and an input's encode; the vision tower's bytes per patch on a 256x256 image (real
    tensors, two layers)."""
    act = full_size[1].activations
    request = Workload(1024, 1024, text_tokens=128, input_images=1)
    full, cached = qi21_transformer_peak(QwenImage21Config(num_layers=1), 1024, 128 + 40, conditions=1)
    assert full <= act.first_step(request) <= 1.3 * full
    assert cached <= act.step(request) <= 1.3 * cached
    uncached, _ = qi21_transformer_peak(QwenImage21Config(num_layers=1), 1024, 128 + 40, cache=False)
    assert (
        uncached <= replace(act, kv_cache=False).step(Workload(1024, 1024, text_tokens=128)) <= 1.3 * uncached
    )
    text = text_encoder_config(QWEN3_VL_8B_TEXT, QWEN3_VL_8B_VISION)
    traced = text_encoder_peak(text, 64 + 40, model_class=Qwen3VLForConditionalGeneration)
    assert traced <= act.encode(Workload(1024, 1024, text_tokens=64)) <= 1.3 * traced
    traced = decode_peak({}, 512, False, AutoencoderKLQwenImage21)
    assert traced <= act.decode(Workload(512, 512), tiled=False) <= 1.3 * traced
    traced = encode_peak({}, 1024, AutoencoderKLQwenImage21)
    assert traced <= act.decode(Workload(32, 32, input_images=1), tiled=True) <= 1.3 * traced
    vision = QWEN3_VL_8B_VISION | {"depth": 2, "deepstack_visual_indexes": [0]}
    per_patch = qi21_vision_peak(vision, 1, 256) / (256 // 16) ** 2 / 1152
    assert per_patch <= VISION_BYTES_PER_WIDTH


@pytest.mark.cpu_dtype
@pytest.mark.parametrize("budget", [16, 24])
def test_full_size_plans_at_16_and_24_gib(full_size, budget, capsys):
    """`info --gpu-memory` prints the plan before loading anything; every phase fits with the two KV caches,
    and a request with four 1024x1024 condition images is refused with the budget it needs."""
    spec, profile = full_size
    plan = plan_memory(profile, budget * GiB, default_workload(spec))
    assert plan.fits(plan.peaks) and plan.placement("text_encoder").mode != RESIDENT
    assert plan.placement("transformer").mode == (STREAM if budget == 16 else RESIDENT)
    with pytest.raises(InputError, match="it needs at least"):
        plan_memory(profile, budget * GiB, Workload(1024, 1024, input_images=4))
    assert main(["info", "--model", str(spec.directory), "--gpu-memory", f"{budget}GiB"]) == 2  # no weights
    out = capsys.readouterr().out
    assert f"GPU memory plan for {budget}.0 GiB (1024x1024, 1 image, true CFG" in out


@pytest.mark.parametrize(
    ("text", "blocks", "cache", "link"),
    [
        (("offload", 0), 0, True, LateLink),  # every block streamed, the cached steps too
        (("offload", 1), 1, True, LateLink),  # one block streamed, the other lending to the text encoder
        (("offload", 0), 0, False, LateLink),  # no KV cache: every step the full pass
    ],
)
def test_a_request_under_a_streaming_placement_gives_the_resident_bytes(tiny, text, blocks, cache, link):
    """Condition image, true CFG and three steps (a full pass, then cached target steps per branch)."""
    request = dict(prompt=PROMPT, image=drawn_image(96, 64, seed=3, mode="RGBA"), width=64, height=32, **CFG)
    resident = load_pipeline(tiny, variant="reference", device="cpu", dtype="fp32")
    pipe = placed_pipeline(tiny, "reference", text, blocks, link(), precision=FP32, lend=blocks > 0)
    for each in (resident, pipe):
        each.model.resolution, each.model.use_kv_cache = RESOLUTION, cache
    assert pipe.memory.plan.placement("transformer").streamed
    assert png_sha256(pipe.generate(**request)[0]) == png_sha256(resident.generate(**request)[0])


@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv-cache", "no-kv-cache"])
def test_a_step_cache_under_a_streaming_placement_gives_the_resident_bytes(tiny, kv_cache):
    """Every block streamed, copies as late as they may run: the steps a step cache skips leave their
    blocks' copies out and the image is the resident pipeline's with the same steps skipped."""
    always = CachePreset("always", threshold=math.inf, warmup_steps=2, max_cached_in_a_row=2)
    request = dict(prompt=PROMPT, width=64, height=32, cache=always, **(CFG | dict(num_inference_steps=6)))
    resident = load_pipeline(tiny, variant="reference", device="cpu", dtype="fp32")
    pipe = placed_pipeline(tiny, "reference", ("offload", 0), 0, LateLink(), precision=FP32)
    for each in (resident, pipe):
        each.model.resolution, each.model.use_kv_cache = RESOLUTION, kv_cache
    assert png_sha256(pipe.generate(**request)[0]) == png_sha256(resident.generate(**request)[0])
    assert pipe.last_run.cache == resident.last_run.cache and pipe.last_run.cache.mean_skipped() > 0


def test_a_planned_pipeline_keeps_one_cache_per_branch(tiny):
    """Under a plan that streams, requests of two shapes leave at most one KV cache per CFG branch on the
    device (the evicted ones let go), no larger than the plan's count; without a plan, up to four."""
    pipe = placed_pipeline(tiny, "reference", ("offload", 0), 0, LateLink(), precision=FP32)
    pipe.model.resolution = RESOLUTION
    planner = pipe.model.planner
    pipe.generate(prompt=PROMPT, width=64, height=32, **CFG)
    first = list(planner.slots.values())
    pipe.generate(prompt=PROMPT, width=64, height=64, **CFG)
    assert len(planner.slots) == 2 and all(slot.buffers is None for slot in first)
    held = sum(slot.buffers.nbytes for slot in planner.slots.values())
    assert 0 < held <= pipe.memory.profile.activations.held(Workload(64, 64, text_tokens=64))
    resident = load_pipeline(tiny, variant="reference", device="cpu", dtype="fp32")
    for size in ((64, 32), (64, 64)):
        resident.generate(prompt=PROMPT, width=size[0], height=size[1], **CFG)
    assert len(resident.model.planner.slots) == 4


def test_generate_with_a_budget_on_the_command_line_writes_the_same_png(tiny, tmp_path, capsys):
    """`qwen-image generate --gpu-memory` on a 2.1 checkpoint at about the smallest budget the planner
    accepts (the CPU standing in for the GPU): the same PNG bytes as without a budget."""
    spec = inspect_checkpoint(tiny)
    profile = spec.family.memory_profile(spec, 4, 4)  # FP32 on this CPU
    request = Workload(64, 64, text_tokens=DEFAULT_SEQUENCE_LENGTH, true_cfg=False)  # the command's defaults
    need = minimum_budget(profile, request, graphs=False, fixed_reserve=0)
    args = ["generate", PROMPT, "--model", str(tiny), "--width", "64", "--height", "64", "--steps", "2"]
    args += ["--seed", "3", "--device", "cpu", "--dtype", "fp32"]
    assert main([*args, "-o", str(tmp_path / "resident.png")]) == 0
    budget = f"{math.ceil(need / 1024**2)}MiB"  # the smallest: the text encoder must leave the device
    assert main([*args, "-o", str(tmp_path / "streamed.png"), "--gpu-memory", budget]) == 0
    assert "memory: " in capsys.readouterr().out
    assert (tmp_path / "streamed.png").read_bytes() == (tmp_path / "resident.png").read_bytes()


def test_a_prompt_longer_than_planned_is_refused_before_it_runs(tiny):
    """2.1 keeps every prompt token, so a request's check counts its prompt's tokens, not
    `max_sequence_length`: a prompt far longer than the plan's text is refused in one line instead of
    running past the budget; a short one runs."""
    spec = inspect_checkpoint(tiny)
    planned = Workload(64, 64, text_tokens=64, true_cfg=False)
    need = minimum_budget(spec.family.memory_profile(spec, 4, 4), planned, graphs=False, fixed_reserve=0)
    budget = f"{math.ceil(need / 1024**2)}MiB"
    where = dict(variant="reference", device="cpu", dtype="fp32")
    pipe = load_pipeline(tiny, **where, gpu_memory=budget, workload=planned)
    args = dict(width=64, height=64, num_inference_steps=2, true_cfg_scale=1.0, seed=1)
    args |= dict(max_sequence_length=64)
    assert pipe.model.prompt_tokens([PROMPT]) < 64
    pipe.generate(prompt=PROMPT, **args)
    long_prompt = " ".join(["a red fox in the snow"] * 400)
    assert pipe.model.prompt_tokens([long_prompt]) > 1024
    with pytest.raises(InputError, match="needs more than"):
        pipe.generate(prompt=long_prompt, **args)
