"""Weights placed for a memory budget give the same bytes as fully resident ones, on the CPU standing in for
the device: the text encoder offloaded (and its layers streamed), transformer blocks streamed through two
slots, for BF16 and FP8 (fused and unfused), with LoRAs in branch and merge mode, loaded before or after
placing. The copies run either when issued (`HostLink`) or as late as a side stream may run them
(`LateLink`: a block that did not wait for its copy would read the previous block's bytes, as a test here
shows); the device holds exactly what the plan counts."""

import math
import mmap
import os
import weakref

import pytest
import torch
from helpers import png_sha256
from lora_files import block_modules, linear_shapes, random_factors, write_lightning
from memory_fixtures import FP32, LateLink, placed_pipeline
from torch.utils._python_dispatch import TorchDispatchMode

import qwen_image_fusion.pipelines.memory as pipeline_memory
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.memory import DENOISE, ENCODE, Workload
from qwen_image_fusion.models.streaming import ALIGN, HostLink, PlacedWeights, moving_tensors
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.memory import DTYPE_BYTES
from qwen_image_fusion.pipelines.memory_plan import (
    OFFLOAD,
    RESERVE_FRACTION,
    gib,
    minimum_budget,
    plan_memory,
)
from qwen_image_fusion.pipelines.precision import pick_numerics
from qwen_image_fusion.ui.cli import main

REQUEST = dict(prompt="a red circle on the left", seed=3, num_inference_steps=2, width=32, height=32)


@pytest.fixture(scope="module")
def resident():
    """The embedded default with everything resident (diffusers' arithmetic in FP32 on this CPU), and
    its image."""
    pipe = load_pipeline(variant="reference", device="cpu", dtype="fp32")
    return pipe, png_sha256(pipe.generate(**REQUEST)[0])


@pytest.mark.parametrize(
    ("text", "blocks", "link", "lend"),
    [
        (("offload", 2), None, LateLink, False),  # the text encoder offloaded whole
        (("offload", 1), 2, LateLink, False),  # one text layer streamed, 2 of 6 blocks resident
        (("offload", 0), 0, HostLink, False),  # everything streamed, copies at once
        (("offload", 0), 0, LateLink, False),  # everything streamed, copies as late as they may run
        (("resident", 2), 5, LateLink, False),  # text encoder resident, one block streamed
        (("offload", 1), 4, LateLink, True),  # resident blocks lend their memory to the text encoder
    ],
)
def test_placed_weights_give_the_resident_bytes(resident, text, blocks, link, lend):
    pipe = placed_pipeline(None, "reference", text, blocks, link(), precision=FP32, lend=lend)
    assert bool(pipe.memory.plan.placement("transformer").lent) == lend
    assert png_sha256(pipe.generate(**REQUEST)[0]) == resident[1]


def test_a_second_request_finds_the_prefetched_text_encoder_in_the_lent_memory(resident):
    """After a request the text encoder is loaded again into the memory the lending blocks give it; the
    next request encodes from there, then the blocks come back. A direct transformer call in between
    takes the memory back first."""
    pipe = placed_pipeline(None, "reference", ("offload", 1), 4, LateLink(), precision=FP32, lend=True)
    text, dit = pipe.memory.placed["text_encoder"], pipe.memory.placed["transformer"]
    for _ in range(2):
        assert png_sha256(pipe.generate(**REQUEST)[0]) == resident[1]
        assert text._phase_buffer is dit._lent_buffer and not dit._lent_loaded  # prefetched into it
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(1, 4, 64, generator=gen), torch.randn(1, 3, 32, generator=gen), None)
    with torch.no_grad():
        out = pipe.transformer(*args, torch.full((1,), 0.5), (1, 2, 2))
        expected = resident[0].transformer(*args, torch.full((1,), 0.5), (1, 2, 2))
    assert torch.equal(out, expected) and text._phase_buffer is None and dit._lent_loaded
    assert png_sha256(pipe.generate(**REQUEST)[0]) == resident[1]


def test_a_block_that_does_not_wait_for_its_copy_reads_stale_bytes(resident, monkeypatch):
    """The test above can fail: without the wait, copies that run late leave the slot's old bytes."""

    def starts_without_waiting(self: PlacedWeights, j: int) -> None:
        self._groups[j].show(self._slot_views[j])

    monkeypatch.setattr(PlacedWeights, "_block_starts", starts_without_waiting)
    pipe = placed_pipeline(None, "reference", ("offload", 2), 0, LateLink(), precision=FP32)
    assert png_sha256(pipe.generate(**REQUEST)[0]) != resident[1]


def test_the_device_holds_what_the_plan_counts(resident):
    """Outside a call: the small tensors, the transformer's fixed part, resident blocks and two slots; the
    offloaded text encoder only its small tensors, and inside its phase its kept layers too. At rest every
    weight reads as the resident pipeline's, byte for byte."""
    pipe = placed_pipeline(None, "reference", ("offload", 1), 2, HostLink(), precision=FP32)
    memory = pipe.memory
    text, dit = memory.plan.placement("text_encoder"), memory.plan.placement("transformer")
    slots = dit.slot_bytes
    assert memory.placed["transformer"].device_bytes() == dit.always() - slots
    assert memory.placed["text_encoder"].device_bytes() == text.part.small
    with memory.phase(ENCODE):
        inside = memory.placed["text_encoder"].device_bytes()
    assert inside == text.part.total - text.streamed_bytes
    assert memory.placed["text_encoder"].device_bytes() == text.part.small
    base = resident[0].transformer.state_dict()
    for name, tensor in pipe.transformer.state_dict().items():
        assert torch.equal(tensor, base[name]), name
    assert isinstance(pipe.transformer.transformer_blocks[5].attn.to_q.weight, torch.nn.Parameter)


class CopyOrder(TorchDispatchMode):
    """Records the copies a placement makes: `copy_` fills a host copy (a tensor leaving the device),
    `_to_copy` brings a tensor to the device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_a_new_placement_lets_blocks_leave_before_others_come(resident):
    """Placed again with the streamed and resident blocks swapped (as a re-plan after a LoRA may do): every
    block that leaves has its host copy before any block comes to the device, so on a GPU the device never
    holds both, and the bytes stay the resident ones."""
    pipe = placed_pipeline(None, "reference", ("offload", 2), 3, HostLink(), precision=FP32)
    dit = pipe.memory.placed["transformer"]
    swapped = tuple(i for i in range(len(dit.blocks)) if i not in dit.streamed)
    order = CopyOrder()
    with order:
        dit.place(swapped, slots=2)
    assert dit.streamed == swapped and "copy_" in order.ops and "_to_copy" in order.ops
    last_leaving = max(i for i, op in enumerate(order.ops) if op == "copy_")
    assert order.ops.index("_to_copy") > last_leaving, order.ops
    assert png_sha256(pipe.generate(**REQUEST)[0]) == resident[1]


@pytest.mark.cpu_dtype
@pytest.mark.parametrize("variant", ["fp8-unfused", "fp8-fused"])
def test_fp8_streamed_equals_resident(fp8_dir, variant):
    """In the dtypes the CPU's default picks (BF16 transformer; the VAE in BF16 or FP32)."""
    resident = load_pipeline(fp8_dir, variant=variant, device="cpu")
    expected = png_sha256(resident.generate(**REQUEST)[0])
    pipe = placed_pipeline(fp8_dir, variant, ("offload", 0), 1, LateLink(), resident.precision)
    assert pipe.variant == variant
    assert png_sha256(pipe.generate(**REQUEST)[0]) == expected


@pytest.fixture(scope="module")
def lightning(tmp_path_factory):
    """A rank-8 LoRA on every block linear, in the Lightning release layout."""
    base = load_pipeline(variant="contract", device="cpu", dtype="bf16")
    shapes = linear_shapes(base.transformer)
    factors = random_factors(shapes, block_modules(base.transformer.config.num_layers), 8, seed=5)
    return write_lightning(tmp_path_factory.mktemp("lora") / "fast.safetensors", factors, 4.0)


@pytest.mark.cpu_dtype
@pytest.mark.parametrize(
    ("model", "variant", "mode"),
    [
        ("bf16", "reference", "branch"),  # PEFT's branch, op for op
        ("bf16", "contract", "merge"),
        ("fp8", "fp8-fused", "branch"),  # the producers write y beside q for the branch
        ("fp8", "fp8-unfused", "merge"),  # requantized FP8 weights
    ],
)
def test_loras_stream_with_their_blocks(fp8_dir, lightning, model, variant, mode):
    """A LoRA loaded after placing: its factors (and merged weights) wait on the host with their blocks;
    images equal the resident pipeline's with the same LoRA, and unloading gives the base bytes back."""
    model_dir = None if model == "bf16" else fp8_dir
    dtype = "fp32" if variant == "reference" else None
    reference = load_pipeline(model_dir, variant=variant, device="cpu", dtype=dtype)
    pipe = placed_pipeline(model_dir, variant, ("offload", 1), 1, LateLink(), reference.precision)
    base = png_sha256(reference.generate(**REQUEST)[0])
    for each in (reference, pipe):
        each.load_lora(lightning, scale=0.7, name="fast")
        each.set_lora_mode(mode)
    if mode == "branch":  # a scale change rebuilds the stacked factors, which stream too
        for each in (reference, pipe):
            each.set_lora_scales({"fast": 1.3})
    assert png_sha256(pipe.generate(**REQUEST)[0]) == png_sha256(reference.generate(**REQUEST)[0])
    streamed = pipe.memory.placed["transformer"]
    wrapper = pipe.transformer.transformer_blocks[5].attn.to_q
    assert wrapper.stream_state() and all(streamed.is_host_copy(t) for t in wrapper.stream_state().values())
    pipe.unload_lora()
    assert png_sha256(pipe.generate(**REQUEST)[0]) == base


@pytest.mark.cpu_dtype
@pytest.mark.parametrize("mode", ["branch", "merge"])
def test_replanning_with_a_lora_loaded_keeps_the_bytes(fp8_dir, lightning, mode):
    """The H200's full-size test's sequence (and back): a resident pipeline re-planned to stream blocks, a
    LoRA loaded, then re-planned to resident and to streaming again; each plan gives the same bytes."""
    largest = Workload(256, 256)  # planned for: its activations leave the blocks no room, so they stream
    pipe = load_pipeline(fp8_dir, variant="fp8-fused", device="cpu", gpu_memory="1GiB", workload=largest)
    need = minimum_budget(pipe.memory.profile, largest, graphs=False, fixed_reserve=0)
    streaming = f"{math.ceil(need / 1024**2) + 1}MiB"
    pipe.set_gpu_memory(streaming, largest)
    base = png_sha256(pipe.generate(**REQUEST)[0])
    pipe.load_lora(lightning, scale=0.7)
    pipe.set_lora_mode(mode)
    assert pipe.memory.plan.placement("transformer").streamed
    streamed = png_sha256(pipe.generate(**REQUEST)[0])
    assert streamed != base
    pipe.set_gpu_memory("1GiB", largest)
    assert pipe.memory.plan.resident
    assert png_sha256(pipe.generate(**REQUEST)[0]) == streamed
    pipe.set_gpu_memory(streaming, largest)
    assert pipe.memory.plan.placement("transformer").streamed
    assert png_sha256(pipe.generate(**REQUEST)[0]) == streamed


def test_a_lora_that_no_longer_fits_streams_more_blocks(lightning, resident):
    """Placed with no room to spare, the pipeline plans again when a LoRA makes its blocks bigger (and the
    new plan still fits)."""
    first = placed_pipeline(None, "reference", ("offload", 2), 3, HostLink(), precision=FP32)
    budget = math.ceil(max(first.memory.plan.peaks.values()) / (1 - RESERVE_FRACTION)) + 1  # just fits
    pipe = placed_pipeline(None, "reference", ("offload", 2), 3, HostLink(), FP32, budget)
    before = pipe.memory.plan.placements
    block_bytes = pipe.memory.profile.part(DENOISE).blocks[0]
    reference = resident[0]
    for each in (pipe, reference):
        each.load_lora(lightning, name="fast")
    after = pipe.memory.plan
    assert [(p.mode, p.streamed, p.lent) for p in after.placements] != [
        (p.mode, p.streamed, p.lent) for p in before
    ]
    assert after.budget == budget and after.fits(after.peaks)
    assert pipe.memory.profile.part(DENOISE).blocks[0] > block_bytes
    try:
        assert png_sha256(pipe.generate(**REQUEST)[0]) == png_sha256(reference.generate(**REQUEST)[0])
    finally:
        reference.unload_lora()


@pytest.mark.cpu_dtype
def test_budget_on_the_cpu_through_load_pipeline_and_request_checks(resident):
    """load_pipeline(gpu_memory=...) on a CPU places the weights for the budget (the CPU standing in), and a
    request larger than the one planned for is refused in one line when it does not fit."""
    pipe = load_pipeline(
        variant="reference", device="cpu", dtype="fp32", gpu_memory="48MiB", workload=Workload(32, 32)
    )
    assert not pipe.memory.plan.resident
    assert png_sha256(pipe.generate(**REQUEST)[0]) == resident[1]
    with pytest.raises(InputError, match="needs more than the 48 MiB"):
        pipe.generate("a red circle", width=1024, height=1024, num_inference_steps=2, num_images_per_prompt=8)
    with pytest.raises(InputError, match="cannot hold this model"):
        load_pipeline(variant="contract", device="cpu", gpu_memory="1MiB")


def test_set_gpu_memory_replans_in_place_both_ways(resident):
    """A streamed plan, then everything resident, then streamed again: the same bytes each time (what leaves
    the device goes to host memory first, so on a GPU the two placements never hold device memory at once)."""
    pipe = load_pipeline(
        variant="reference", device="cpu", dtype="fp32", gpu_memory="48MiB", workload=Workload(32, 32)
    )
    streamed = pipe.memory.plan
    pipe.set_gpu_memory("1GiB", Workload(32, 32))
    assert pipe.memory.plan.resident and not streamed.resident
    assert png_sha256(pipe.generate(**REQUEST)[0]) == resident[1]
    pipe.set_gpu_memory("48MiB", Workload(32, 32))
    assert pipe.memory.plan.summary() == streamed.summary()
    assert png_sha256(pipe.generate(**REQUEST)[0]) == resident[1]


@pytest.mark.cpu_dtype
def test_generate_with_a_budget_on_the_command_line_writes_the_same_png(tmp_path, capsys):
    """`qwen-image generate --gpu-memory` (on the CPU, standing in for the GPU) at about the smallest budget
    the planner accepts for the request (the text encoder offloaded into the memory the blocks lend it):
    the same PNG bytes as without a budget."""
    spec = inspect_checkpoint(None)
    _, precision = pick_numerics(spec.weights, "auto", torch.device("cpu"))  # what the command will pick
    profile = spec.family.memory_profile(spec, DTYPE_BYTES[precision.dtype], DTYPE_BYTES[precision.vae_dtype])
    need = minimum_budget(profile, Workload(32, 32, text_tokens=512), graphs=False, fixed_reserve=0)
    args = ["generate", "a red circle on the left", "--width", "32", "--height", "32", "--steps", "2"]
    args += ["--seed", "3", "--device", "cpu"]
    assert main([*args, "-o", str(tmp_path / "resident.png")]) == 0
    budget = f"{math.ceil(need / 1024**2) + 1}MiB"  # + the buffers no header lists (rotary tables)
    assert main([*args, "-o", str(tmp_path / "streamed.png"), "--gpu-memory", budget]) == 0
    out = capsys.readouterr().out
    assert "memory: " in out and "lent to the text encoder" in out
    assert (tmp_path / "streamed.png").read_bytes() == (tmp_path / "resident.png").read_bytes()


class HostBuffers:
    """Every host buffer the placements make (anonymous maps), alive as long as a tensor uses its memory."""

    def __init__(self) -> None:
        self.maps: weakref.WeakSet = weakref.WeakSet()
        self.peak = 0

    def make(self, *args, **kwargs) -> mmap.mmap:
        made = TrackedMap(*args, **kwargs)
        self.maps.add(made)
        self.peak = max(self.peak, self.live())
        return made

    def live(self) -> int:
        return sum(len(m) for m in self.maps)


class TrackedMap(mmap.mmap):
    pass


def host_bytes(pipe, placements, either=None, align: int = ALIGN) -> int:
    """Bytes of the moving tensors a plan keeps in host memory (with `either`, what either of two plans
    keeps there), each tensor at its size rounded up to `align`, computed from the modules."""

    def size(tensors) -> int:
        return sum(-(-m.nbytes // align) * align for m in tensors)

    total = 0
    for placement in placements:
        others = [] if either is None else [either.placement(placement.part.name)]
        modes = {p.mode for p in (placement, *others)}
        placed = pipe.memory.placed[placement.part.name]
        if OFFLOAD in modes:
            total += size(moving_tensors(placed.root))
            continue
        away = {i for p in (placement, *others) for i in (*p.streamed, *p.lent)}
        total += sum(size(moving_tensors(placed.blocks[i])) for i in away)
    return total


def distinct_plans(profile, workload: Workload) -> list[tuple[int, Workload]]:
    """A budget for each distinct plan from the smallest budget up, largest first."""
    low = minimum_budget(profile, workload, graphs=False, fixed_reserve=0)
    plans = {}
    for step in range(60):
        budget = low + step * low // 40
        plans.setdefault(plan_memory(profile, budget, workload, False, 0).summary().split(":", 1)[1], budget)
    return [(budget, workload) for budget in sorted(plans.values(), reverse=True)]


def test_replanning_keeps_host_memory_to_what_the_plans_keep_there(resident, monkeypatch):
    """Re-planned from blocks lent to the offloaded text encoder through fewer and fewer resident blocks,
    one back up, then everything resident: after each re-plan the live host buffers hold exactly the tensors
    the plan keeps off the device, and while it re-plans no more than what either plan keeps there (the
    H200's full-size test ran out of its 128 GiB of host memory when every re-plan copied everything to the
    host and kept each buffer while any tensor lived in it)."""
    buffers = HostBuffers()
    monkeypatch.setattr(mmap, "mmap", buffers.make)
    pipe = load_pipeline(variant="reference", device="cpu", dtype="fp32", gpu_memory="1GiB")
    lent = distinct_plans(pipe.memory.profile, Workload(32, 32))[1]
    streamed = distinct_plans(pipe.memory.profile, Workload(256, 256))  # activations leave blocks less room
    assert len(streamed) >= 4, streamed
    sequence = [lent, *streamed[1:3], streamed[-1], streamed[2], lent, (2**30, Workload(32, 32))]
    for budget, workload in sequence:
        before = pipe.memory.plan
        buffers.peak = buffers.live()
        pipe.set_gpu_memory(budget, workload)
        after = pipe.memory.plan
        assert buffers.live() == host_bytes(pipe, after.placements), after.summary()
        assert after.host_bytes == host_bytes(pipe, after.placements, align=1), after.summary()
        assert buffers.peak <= host_bytes(pipe, after.placements, either=before), after.summary()
    assert pipe.memory.plan.resident and buffers.live() == 0
    assert png_sha256(pipe.generate(**REQUEST)[0]) == resident[1]


def test_a_plan_that_needs_more_host_memory_than_there_is_is_refused(resident, monkeypatch, capsys, tmp_path):
    """The weights a plan keeps in host memory are checked against what the host has available, when the
    pipeline loads and when it re-plans (counting the host copies it holds already), so a plan too large
    for the machine's RAM is one line, not a process the kernel stops with no message."""
    available = {"bytes": 1024**2}
    monkeypatch.setattr(pipeline_memory, "host_memory_available", lambda: available["bytes"])
    small = dict(variant="reference", device="cpu", dtype="fp32", gpu_memory="48MiB")
    small["workload"] = Workload(32, 32)
    refused = r"keeps \d+ MiB more weights in host memory, but this machine has 1 MiB available"
    with pytest.raises(InputError, match=refused):
        load_pipeline(**small)
    args = ["generate", "a red circle", "--width", "32", "--height", "32", "--steps", "2", "--device", "cpu"]
    args += ["--dtype", "fp32"]  # as `small`: FP32 weights are what the 1 MiB of host memory cannot hold
    assert main([*args, "--gpu-memory", "48MiB", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the 48 MiB GPU memory plan keeps"), err
    available["bytes"] = 2**40
    spec = inspect_checkpoint(None)
    workload = Workload(256, 256)  # its activations leave the blocks little room: they stream
    plans = distinct_plans(spec.family.memory_profile(spec, 4, 4), workload)
    pipe = load_pipeline(**(small | dict(gpu_memory=plans[2][0], workload=workload)))
    held = pipe.memory.plan.host_bytes
    budget = plans[-1][0]
    more = plan_memory(pipe.memory.profile, budget, workload, False, 0).host_bytes - held
    assert held > 0 and more > 0
    available["bytes"] = more - 1
    with pytest.raises(InputError, match="more weights in host memory"):
        pipe.set_gpu_memory(budget, workload)
    available["bytes"] = more
    pipe.set_gpu_memory(budget, workload)
    assert pipe.memory.plan.host_bytes == held + more
    assert png_sha256(pipe.generate(**REQUEST)[0]) == resident[1]


def test_available_host_memory_is_read_from_the_kernel():
    """MemAvailable, in bytes: above zero and below the machine's physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < pipeline_memory.host_memory_available() < physical


@pytest.mark.cpu_dtype
def test_merging_more_original_weights_than_the_host_holds_is_refused(lightning, monkeypatch):
    """Merge mode keeps each changed layer's original weight in host memory: when that is more than the
    host has available, switching to merge or loading another LoRA in merge mode is refused in one line
    and the pipeline is left as it was."""
    available = {"bytes": 0}
    monkeypatch.setattr(pipeline_memory, "host_memory_available", lambda: available["bytes"])
    pipe = load_pipeline(variant="contract", device="cpu")
    shapes = linear_shapes(pipe.transformer)
    element = pipe.transformer.proj_out.weight.element_size()
    changed = block_modules(len(pipe.transformer.transformer_blocks))  # every block linear: the LoRA's
    originals = sum(shapes[name][0] * shapes[name][1] * element for name in changed)
    pipe.load_lora(lightning, name="fast")
    branch = png_sha256(pipe.generate(**REQUEST)[0])
    with pytest.raises(InputError, match=f"keeps {gib(originals)} of original weights in host memory"):
        pipe.set_lora_mode("merge")
    assert pipe.lora_mode == "branch" and png_sha256(pipe.generate(**REQUEST)[0]) == branch
    available["bytes"] = originals
    pipe.set_lora_mode("merge")
    merged = png_sha256(pipe.generate(**REQUEST)[0])
    available["bytes"] = 0
    outside = random_factors(shapes, ["img_in", "proj_out"], 4, seed=9)
    other = write_lightning(lightning.parent / "outside.safetensors", outside, 1.0)
    with pytest.raises(InputError, match="original weights in host memory"):
        pipe.load_lora(other, name="outside")
    assert list(pipe.loras) == ["fast"] and png_sha256(pipe.generate(**REQUEST)[0]) == merged
