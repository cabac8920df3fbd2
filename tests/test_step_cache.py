"""The step cache (models/step_cache.py), opt-in and approximate: its rule checked against an independent
re-computation on a toy block stack, and through the pipeline for every family: off is the exact path, on
it skips the middle blocks in the steps it reports, fused and unfused FP8 skip the same steps with the same
bytes, a request keeps its bytes in a batch, and a memory plan that streams blocks gives the resident
bytes with the skipped blocks' copies left out."""

import math
from dataclasses import replace

import pytest
import torch
from edit_fixtures import build_edit_checkpoint, drawn_image, our_edit_pipeline
from helpers import png_sha256
from lora_files import block_modules, linear_shapes, random_factors, write_lightning
from memory_fixtures import FP32, LateLink, placed_pipeline
from qi21_checkpoints import RESOLUTION, build_qi21_checkpoint

from qwen_image_fusion.eval.variants import parse_variant
from qwen_image_fusion.models.cache_presets import CACHE_PRESETS, CachePreset, get_cache_preset
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.memory import DENOISE, Workload
from qwen_image_fusion.models.step_cache import BranchCache, caching, run_blocks
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.memory_plan import with_workload
from qwen_image_fusion.pipelines.run_info import CacheReport
from qwen_image_fusion.pipelines.variants import VARIANTS

# Skips whenever it may: the schedule is then warm-up, then `max_cached_in_a_row` skipped, one computed, ...
ALWAYS = CachePreset("always", threshold=math.inf, warmup_steps=2, max_cached_in_a_row=2)
# Never skips (no change is below 0): the cache's machinery runs every step, and must add nothing
NEVER = CachePreset("never", threshold=0.0, warmup_steps=2, max_cached_in_a_row=2)
# On the tiny FP8 checkpoint below, its threshold lets some steps skip and makes others run
MIDWAY = CachePreset("midway", threshold=0.3, warmup_steps=2, max_cached_in_a_row=3)
SMALL = dict(prompt="a red circle on the left", negative_prompt=" ", width=32, height=32, seed=3)


def always_schedule(steps: int) -> list[bool]:
    """Per step, whether ALWAYS runs the middle blocks (written out from its definition)."""
    computed, in_a_row = [], 0
    for step in range(steps):
        compute = step < ALWAYS.warmup_steps or in_a_row >= ALWAYS.max_cached_in_a_row
        in_a_row = 0 if compute else in_a_row + 1
        computed.append(compute)
    return computed


def toy_block(i: int, streams: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    image, text = streams
    return torch.tanh(image * (1 + 0.1 * i) + text.mean(1, keepdim=True)), text + 0.01 * (i + 1)


def test_the_rule_decides_per_row_against_an_independent_recomputation() -> None:
    """Row 0's input barely moves between calls, row 1's jumps: row 0 skips (after the warm-up, at most
    `max_cached_in_a_row` calls in a row) with the front output plus the middle residual of its last
    computed call; row 1 always runs every block and equals the plain loop bit for bit."""
    preset = CachePreset(
        "t", threshold=0.05, front_blocks=1, back_blocks=1, warmup_steps=2, max_cached_in_a_row=3
    )
    cache = BranchCache(preset)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(2, 5, 4, generator=generator)
    text = torch.randn(2, 3, 4, generator=generator)
    blocks = 5
    residual = [None, None]  # per row: middle residuals (image, text) of its last computed call
    front_residual = [None, None]
    in_a_row, skipped = [0, 0], [0, 0]
    for call in range(10):
        image = base.clone()
        image[0] += 1e-4 * call
        image[1] += torch.randn(5, 4, generator=generator)
        with caching(cache):
            got = run_blocks(blocks, (image, text), toy_block)
        plain = (image, text)
        for i in range(blocks):
            plain = toy_block(i, plain)
        front = toy_block(0, (image, text))
        middle = front
        for i in range(1, blocks - 1):
            middle = toy_block(i, middle)
        for row in range(2):
            this_front = (front[0][row] - image[row]).double()
            if front_residual[row] is None:
                change = math.inf
            else:
                previous = front_residual[row].double()
                change = float((this_front - previous).abs().mean() / previous.abs().mean())
            compute = call < 2 or not change < preset.threshold or in_a_row[row] >= 3
            in_a_row[row] = 0 if compute else in_a_row[row] + 1
            skipped[row] += not compute
            if compute:
                front_residual[row] = front[0][row] - image[row]
                residual[row] = (middle[0][row] - front[0][row], middle[1][row] - front[1][row])
                want = (plain[0][row], plain[1][row])
            else:
                mid = (front[0][row] + residual[row][0], front[1][row] + residual[row][1])
                want = toy_block(blocks - 1, (mid[0][None], mid[1][None]))
                want = (want[0][0], want[1][0])
            assert torch.equal(got[0][row], want[0]) and torch.equal(got[1][row], want[1]), (call, row)
    assert cache.skipped == skipped and skipped[0] >= 4 and skipped[1] == 0


def test_presets_and_their_names() -> None:
    assert get_cache_preset(None) is None and get_cache_preset("off") is None
    assert get_cache_preset("fast") is CACHE_PRESETS["fast"] and get_cache_preset(ALWAYS) is ALWAYS
    with pytest.raises(InputError, match=r"cache 'fastest' is not a step-cache preset \(fast, faster, or"):
        get_cache_preset("fastest")
    with pytest.raises(InputError, match="at least 1"):
        CachePreset("x", threshold=0.1, warmup_steps=0)
    spec = parse_variant("fp8-fused+cache:fast:cpu:bf16", VARIANTS)
    assert (spec.name, spec.cache, spec.device, spec.dtype) == ("fp8-fused", "fast", "cpu", "bf16")
    assert parse_variant("contract", VARIANTS).cache is None
    with pytest.raises(InputError, match=r"\+cache:PRESET"):
        parse_variant("contract+cache:nope", VARIANTS)


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(variant="reference", device="cpu", dtype="fp32")


def test_off_is_exact_and_a_cache_skips_the_steps_it_reports(pipe) -> None:
    steps = 8
    exact = png_sha256(pipe.generate(**SMALL, num_inference_steps=steps)[0])
    assert pipe.last_run.cache is None
    assert png_sha256(pipe.generate(**SMALL, num_inference_steps=steps, cache="off")[0]) == exact
    blocks = pipe.transformer.transformer_blocks
    calls = {0: 0, 1: 0, len(blocks) - 1: 0}
    hooks = [
        blocks[i].register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)) for i in calls
    ]
    try:
        cached = pipe.generate(**SMALL, num_inference_steps=steps, cache=ALWAYS)[0]
    finally:
        for hook in hooks:
            hook.remove()
    computed = sum(always_schedule(steps))
    assert calls == {0: 2 * steps, 1: 2 * computed, len(blocks) - 1: 2 * computed}
    skipped = steps - computed
    assert pipe.last_run.cache == CacheReport(
        "always", steps, {"positive": (skipped,), "negative": (skipped,)}, cfg=True
    )
    again = pipe.generate(**SMALL, num_inference_steps=steps)[0]
    assert png_sha256(again) == exact != png_sha256(cached)
    assert png_sha256(pipe.generate(**SMALL, num_inference_steps=steps, cache=ALWAYS)[0]) == png_sha256(
        cached
    )
    assert_exact_when_nothing_is_skipped(pipe, dict(SMALL, num_inference_steps=steps), exact)


def assert_exact_when_nothing_is_skipped(pipe, request: dict, exact: str) -> None:
    """A cache that decides to compute every step gives the exact path's bytes: the cache's own machinery
    (front residual, buffers, per-branch decisions) changes nothing it does not skip."""
    assert png_sha256(pipe.generate(**request, cache=NEVER)[0]) == exact
    assert pipe.last_run.cache.skipped == dict.fromkeys(pipe.last_run.cache.skipped, (0,))


def test_a_request_keeps_its_bytes_in_a_batch_with_a_cache(pipe) -> None:
    """Decisions are per row: each request's PNG is the same alone (padded to 3 rows) and batched."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        requests = [
            pipe.request(f"a {c} square at the top", negative_prompt=" ", width=32, height=32, seed=s,
                         num_inference_steps=8, cache="faster")
            for s, c in enumerate(("red", "blue", "green"))
        ]  # fmt: skip
        alone = [pipe.run([r], slots=3)[0] for r in requests]
        together = pipe.run(requests, slots=3)
    finally:
        torch.set_num_threads(threads)
    assert [png_sha256(r.images[0]) for r in together] == [png_sha256(r.images[0]) for r in alone]
    assert [r.info.cache for r in together] == [r.info.cache for r in alone]
    assert {r.info.cache.preset for r in together} == {"faster"}


class CountingLink(LateLink):
    """`LateLink`, counting the bytes each transformer call copies in."""

    def __init__(self) -> None:
        super().__init__()
        self.copied = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copied += src.numel() * src.element_size()
        super().copy(dst, src)


# Like ALWAYS, with the last block always run: the streamed blocks after the skipped ones still come in
ALWAYS_BACK = CachePreset(
    "always-back", threshold=math.inf, back_blocks=1, warmup_steps=2, max_cached_in_a_row=2
)


@pytest.mark.parametrize(
    ("preset", "text", "blocks", "lend"),
    [
        (ALWAYS, ("offload", 0), 0, False),  # every block streamed
        (ALWAYS_BACK, ("offload", 0), 0, False),
        (MIDWAY, ("offload", 1), 2, False),  # the rule deciding from the data, 4 of 6 blocks streamed
        (ALWAYS_BACK, ("offload", 1), 4, True),  # resident blocks lending to the text encoder
    ],
    ids=["all-streamed", "all-streamed-back-block", "midway", "lent"],
)
def test_a_plan_that_streams_blocks_gives_the_resident_bytes_with_a_cache(pipe, preset, text, blocks, lend):
    """Copies running as late as a side stream may run them: a skipped block's copy is never waited for,
    the blocks after it still wait for theirs, and the image is the resident pipeline's with the same
    steps skipped."""
    request = dict(SMALL, num_inference_steps=8, cache=preset)
    placed = placed_pipeline(None, "reference", text, blocks, LateLink(), precision=FP32, lend=lend)
    assert png_sha256(placed.generate(**request)[0]) == png_sha256(pipe.generate(**request)[0])
    assert placed.last_run.cache == pipe.last_run.cache and placed.last_run.cache.mean_skipped() > 0


def test_a_skipped_call_copies_only_the_blocks_already_under_way(pipe):
    """Every block streamed through two slots: a computed call copies all six blocks, a skipped one (F1B0)
    only the three issued before its decision (the first two as it begins, the third as block 0 ends)."""
    link = CountingLink()
    placed = placed_pipeline(None, "reference", ("offload", 0), 0, link, precision=FP32)
    dit = placed.memory.placed["transformer"]
    assert dit.slots == 2 and len(dit.streamed) == len(dit.blocks) == 6
    block_bytes = [g.nbytes for g in dit._groups]
    cache = BranchCache(ALWAYS, dit)
    per_call = []
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(1, 4, 64, generator=gen), torch.randn(1, 3, 32, generator=gen), None)
    with torch.no_grad(), caching(cache):
        for _ in range(3):
            link.copied = 0
            placed.transformer(*args, torch.full((1,), 0.5), (1, 2, 2))
            per_call.append(link.copied)
    assert per_call[:2] == [sum(block_bytes)] * 2  # the warm-up calls run every block
    assert per_call[2] < sum(block_bytes) and cache.skipped == [1]


def test_eager_calls_keep_one_shape_of_buffers(pipe) -> None:
    """Requests of other sizes and prompt lengths do not pile up buffers: eager calls hold no addresses,
    so each branch keeps the current shape's only (captured graphs let go of theirs when dropped)."""
    for prompt, width in (("a red circle", 32), ("a blue square at the bottom right", 48)):
        pipe.generate(**(SMALL | dict(prompt=prompt, width=width)), num_inference_steps=3, cache=ALWAYS)
        shapes = [tuple(b.outputs[0].shape) for b in pipe._caches[(ALWAYS, 0)].buffers.values()]
        assert len(shapes) == 1 and shapes[0][1] == width // 16 * 2


def test_the_memory_plan_counts_the_cache_buffers() -> None:
    """A request with a cache has its buffers counted in the plan's peaks, for each CFG branch, and the
    estimate holds what the cache keeps."""
    planned = load_pipeline(variant="reference", device="cpu", dtype="fp32", gpu_memory="1GiB")
    planned.generate(**SMALL, num_inference_steps=4, cache=ALWAYS)
    caches = [planned._caches[(ALWAYS, b)] for b in range(2)]
    (buf,) = caches[0].buffers.values()
    kept = [buf.front_residual, *buf.middle_residuals, *buf.outputs, buf.metric, buf.compute_rows]
    held = sum(t.numel() * t.element_size() for t in kept)
    activations = planned.memory.profile.activations
    workload = Workload(SMALL["width"], SMALL["height"], text_tokens=buf.outputs[1].shape[1], step_cache=True)
    assert held <= activations.step_cache(workload) < 2 * held
    plan, profile = planned.memory.plan, planned.memory.profile
    with_cache = with_workload(plan, profile, workload).peaks[DENOISE]
    without = with_workload(plan, profile, replace(workload, step_cache=False)).peaks[DENOISE]
    assert with_cache - without == 2 * activations.step_cache(workload)
    assert "step cache" in workload.describe()


@pytest.mark.parametrize("preset", [ALWAYS, MIDWAY], ids=lambda p: p.name)
def test_fused_and_unfused_fp8_skip_the_same_steps_with_the_same_bytes(fp8_dir, preset) -> None:
    pipe = load_pipeline(fp8_dir, variant="fp8-fused", device="cpu", dtype="bf16")
    results = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        images = pipe.generate(**SMALL, num_inference_steps=10, cache=preset)
        results[variant] = (png_sha256(images[0]), pipe.last_run.cache)
    assert pipe.variant == "fp8-unfused" and results["fp8-fused"] == results["fp8-unfused"]
    assert results["fp8-fused"][1].mean_skipped() > 0


@pytest.mark.parametrize("mode", ["branch", "merge"])
def test_a_lora_runs_with_a_cache_fused_equal_to_unfused(fp8_dir, tmp_path, mode: str) -> None:
    pipe = load_pipeline(fp8_dir, variant="fp8-fused", device="cpu", dtype="bf16")
    modules = block_modules(pipe.transformer.config.num_layers)
    shapes = linear_shapes(pipe.transformer)
    factors = random_factors(shapes, modules, 8, seed=2, std=0.1, dtype=torch.bfloat16)
    base = png_sha256(pipe.generate(**SMALL, num_inference_steps=10, cache=MIDWAY)[0])
    pipe.load_lora(write_lightning(tmp_path / "lora.safetensors", factors, 8.0), scale=0.8)
    pipe.set_lora_mode(mode)
    results = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        image = pipe.generate(**SMALL, num_inference_steps=10, cache=MIDWAY)[0]
        results[variant] = (png_sha256(image), pipe.last_run.cache, pipe.last_run.loras)
    assert results["fp8-fused"] == results["fp8-unfused"] and results["fp8-fused"][0] != base
    assert results["fp8-fused"][2].startswith(f"LoRA ({mode})")


def test_edit_2511_runs_a_cache_and_off_stays_exact(tmp_path) -> None:
    """At the tests' small image areas (edit_fixtures): the cache's decisions do not depend on them."""
    directory = build_edit_checkpoint(tmp_path / "edit", "QwenImageEditPlusPipeline", zero_cond_t=True)
    pipe = our_edit_pipeline(directory)
    edit = dict(prompt="make it blue", image=drawn_image(64, 48, seed=1), negative_prompt=" ", seed=2)
    edit |= dict(num_inference_steps=6, width=64, height=48)
    exact = png_sha256(pipe.generate(**edit)[0])
    cached = png_sha256(pipe.generate(**edit, cache=ALWAYS)[0])
    skipped = 6 - sum(always_schedule(6))
    assert pipe.last_run.cache.skipped == {"positive": (skipped,), "negative": (skipped,)}
    assert png_sha256(pipe.generate(**edit, cache="off")[0]) == exact != cached
    assert_exact_when_nothing_is_skipped(pipe, edit, exact)


@pytest.fixture(scope="module")
def qi21_pipe(tmp_path_factory):
    """A tiny Qwen-Image 2.1 checkpoint's reference pipeline at the tests' small resolution."""
    directory = build_qi21_checkpoint(tmp_path_factory.mktemp("qi21") / "ckpt")
    pipe = load_pipeline(directory, variant="reference", device="cpu", dtype="fp32")
    pipe.model.resolution = RESOLUTION
    return pipe


@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv-cache", "no-kv-cache"])
def test_qwen_image_21_runs_a_cache_with_and_without_its_kv_cache(qi21_pipe, kv_cache: bool) -> None:
    pipe = qi21_pipe
    pipe.model.use_kv_cache = kv_cache
    request = dict(prompt="make it snow", image=drawn_image(96, 64, seed=3), negative_prompt="blurry")
    request |= dict(true_cfg_scale=3.0, num_inference_steps=6, seed=4)
    exact = png_sha256(pipe.generate(**request)[0])
    cached = png_sha256(pipe.generate(**request, cache=ALWAYS)[0])
    skipped = 6 - sum(always_schedule(6))
    assert pipe.last_run.cache.skipped == {"positive": (skipped,), "negative": (skipped,)}
    assert png_sha256(pipe.generate(**request)[0]) == exact != cached
    assert_exact_when_nothing_is_skipped(pipe, request, exact)
