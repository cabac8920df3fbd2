"""The GPU-memory planner, torch-free: sizes read from safetensors headers equal the loaded tensors' bytes,
each budget gets the cheapest plan whose every phase fits, a budget that cannot work is refused with the
smallest one that would, and `info --gpu-memory` prints the plan of a full-size checkpoint on this CPU."""

import argparse
import dataclasses
import itertools
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from transformers import Qwen2_5_VLConfig

from bench.activation_memory import decode_peak, text_encoder_peak, transformer_peak
from bench.header_checkpoint import header_only_checkpoint, write_header
from qwen_image_fusion.models.checkpoint import read_json
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.family import MAX_SEQUENCE_LENGTH
from qwen_image_fusion.models.memory import DECODE, DENOISE, ENCODE, Workload, part_sizes, read_header
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.family import QwenImageFamily
from qwen_image_fusion.models.qwen_image.memory import QwenImageActivations
from qwen_image_fusion.models.qwen_image.prompt_template import DROP_TOKENS
from qwen_image_fusion.models.streaming import moving_tensors
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.memory import plan_for
from qwen_image_fusion.pipelines.memory_plan import (
    OFFLOAD,
    RESIDENT,
    STREAM,
    GiB,
    evenly,
    minimum_budget,
    parse_size,
    plan_memory,
    reserve,
    with_workload,
)
from qwen_image_fusion.ui.cli import main
from qwen_image_fusion.ui.commands import gpu_memory_plan

FULL = Workload(1024, 1024)


@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    """The public Qwen-Image's sizes (FP8 transformer, default BF16 fallback), headers only."""
    directory = header_only_checkpoint(tmp_path_factory.mktemp("qwen-image-fp8"))
    spec = inspect_checkpoint(directory)
    return spec, spec.family.memory_profile(spec, 2, 2)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GiB", 24 * 1024**3),
        ("24 GiB", 24 * 1024**3),
        ("24", 24 * 1024**3),
        ("24GB", 24 * 10**9),
        ("16000MiB", 16000 * 1024**2),
        ("0.5gib", 512 * 1024**2),
    ],
)
def test_sizes_parse_in_binary_and_decimal_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["24XB", "", "GiB", "-3GiB", "0GiB", "24 G iB"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(InputError, match="GPU memory"):
        parse_size(text)


def test_header_sizes_are_the_bytes_the_loaded_components_hold():
    """What the planner reads from the headers (no weight read) is what loading puts on the device, per
    component, per block and for the small tensors that never move."""
    spec = inspect_checkpoint(None)
    pipe = load_pipeline(variant="contract", device="cpu", dtype="bf16")
    profile = spec.family.memory_profile(spec, 2, 2)
    for part in profile.parts:
        module = getattr(pipe.components, part.name)
        blocks = [] if part.block_path is None else list(module.get_submodule(part.block_path))
        stored = module.state_dict().values()  # no non-persistent buffers (rotary tables): not stored
        assert part.small == sum(t.numel() * t.element_size() for t in stored if t.dim() < 2), part.name
        assert part.blocks == tuple(sum(m.nbytes for m in moving_tensors(b)) for b in blocks), part.name
        assert part.fixed == sum(m.nbytes for m in moving_tensors(module, skip=blocks)), part.name


def test_full_size_parts_match_the_published_sizes(full_size):
    """Issue 24's figures: FP8 transformer 28 GiB of which the BF16 modulation 13.6 GB, 60 blocks; a
    Qwen2.5-VL-7B-sized text encoder of 15 GB in 28 layers."""
    _, profile = full_size
    text, transformer = profile.part(ENCODE), profile.part(DENOISE)
    assert len(transformer.blocks) == 60 and len(set(transformer.blocks)) == 1
    modulation = 60 * 2 * 3072 * 18432 * 2
    assert modulation == pytest.approx(13.6e9, rel=0.01)
    assert 28e9 < transformer.total < 30e9
    assert len(text.blocks) == 28 and 15e9 < text.total < 15.5e9


def counted_peaks(profile, plan) -> dict[str, int]:
    """Each phase's device bytes counted from the plan's block lists and the activation model, without the
    planner's own arithmetic (`phase_peaks`, `Placement.always/during`): a component is on the device whole
    but its streamed blocks (which share `slots` buffers of the largest), except an offloaded one outside its
    phase (its small tensors only); while the text encoder runs, the blocks lent to it hold its buffer."""
    act, workload = profile.activations, plan.workload
    step = act.step(workload)
    pools = (2 if workload.true_cfg else 1) * step * plan.graphs + act.held(workload)
    activations = {
        ENCODE: act.encode(workload),
        DENOISE: max(step, act.first_step(workload)),
        DECODE: act.decode(workload, plan.tiled_decode),
    }
    peaks = {}
    for phase, active in activations.items():
        weights = 0
        lent = sum(b for p in plan.placements for i, b in enumerate(p.part.blocks) if i in p.lent)
        for p in plan.placements:
            part = p.part
            kept = sum(b for i, b in enumerate(part.blocks) if i not in p.streamed)
            slots = p.slots * max([part.blocks[i] for i in p.streamed] or [0])
            if p.mode == OFFLOAD and part.phase != phase:
                weights += part.small
            elif p.mode == OFFLOAD and phase == ENCODE:  # its buffer takes the lent blocks' place
                weights += part.small + max(part.fixed + kept + slots, lent)
            else:
                own_lent = sum(b for i, b in enumerate(part.blocks) if i in p.lent)
                weights += part.small + part.fixed + kept + slots - (own_lent if phase == ENCODE else 0)
        peaks[phase] = weights + active + pools
    return peaks


def cost(plan):
    return plan.bytes_per_step, plan.tiled_decode, plan.bytes_per_request


def test_plans_get_cheaper_with_budget_and_every_phase_fits(full_size):
    _, profile = full_size
    previous = None
    for budget in (12, 16, 20, 24, 28, 32, 40, 48, 64, 80):
        plan = plan_memory(profile, budget * GiB, FULL)
        assert max(plan.peaks.values()) + reserve(budget * GiB) <= budget * GiB
        assert plan.peaks == counted_peaks(profile, plan)
        if previous is not None:  # by the planner's own order: bytes per step, tiling, bytes per request
            assert plan.bytes_per_step <= previous.bytes_per_step
            assert cost(plan) <= cost(previous)
        previous = plan
    assert previous.resident and previous.bytes_per_step == previous.bytes_per_request == 0


def test_the_order_of_plans_follows_the_issue(full_size):
    """Resident when all fits; then the text encoder offloaded with the transformer resident; then blocks
    streamed; a budget below the smallest is refused with it."""
    _, profile = full_size
    resident = plan_memory(profile, 80 * GiB, FULL)
    assert resident.resident and not resident.tiled_decode
    offload = plan_memory(profile, 40 * GiB, FULL)
    modes = {p.part.name: p.mode for p in offload.placements}
    assert modes == {"text_encoder": OFFLOAD, "transformer": RESIDENT, "vae": RESIDENT}
    assert offload.bytes_per_step == 0 and offload.bytes_per_request == profile.part(ENCODE).total - (
        profile.part(ENCODE).small
    )
    streamed = plan_memory(profile, 16 * GiB, FULL)
    transformer = streamed.placement("transformer")
    assert transformer.mode == STREAM and 0 < len(transformer.streamed) < 60 and transformer.slots == 2
    assert streamed.bytes_per_step == 2 * transformer.streamed_bytes  # two CFG branches a step
    assert streamed.tiled_decode
    need = minimum_budget(profile, FULL)
    plan_memory(profile, need, FULL)
    with pytest.raises(InputError, match=f"needs at least {need / GiB:.1f} GiB"):
        plan_memory(profile, need - 64 * 1024**2, FULL)


def test_streamed_blocks_are_spread_evenly_and_end_with_the_last():
    assert evenly(0, 60) == ()
    assert evenly(1, 60) == (59,)
    assert evenly(60, 60) == tuple(range(60))
    spread = evenly(15, 60)
    assert spread[-1] == 59 and spread[0] == 3 and len(set(spread)) == 15
    assert {b - a for a, b in itertools.pairwise(spread)} == {4}


def test_a_request_beyond_the_planned_one_is_refused_or_decoded_in_tiles(full_size):
    _, profile = full_size
    plan = plan_memory(profile, 48 * GiB, Workload(512, 512))
    assert not plan.tiled_decode
    bigger = with_workload(plan, profile, Workload(1024, 1024))
    assert bigger.tiled_decode and bigger.placements == plan.placements
    with pytest.raises(InputError, match=r"needs more than the 48\.0 GiB"):
        with_workload(plan, profile, Workload(2048, 2048, images=8))


def test_activations_grow_with_the_request(full_size):
    _, profile = full_size
    act = profile.activations
    small, large = Workload(512, 512), Workload(1024, 1024, images=2)
    assert act.step(large) > 3 * act.step(small)
    assert act.decode(large, tiled=False) == 8 * act.decode(small, tiled=False)
    assert act.decode(large, tiled=True) < act.decode(large, tiled=False) / 4


def test_sizes_skip_small_tensors_and_group_blocks(tmp_path):
    path = tmp_path / "x.safetensors"
    write_header(
        path,
        {
            "blocks.0.w": (torch.bfloat16, (4, 8)),
            "blocks.0.b": (torch.bfloat16, (4,)),
            "blocks.1.w": (torch.float8_e4m3fn, (4, 8)),
            "emb": (torch.float32, (10, 2)),
            "scale": (torch.float32, ()),
        },
    )
    tensors = read_header(path)
    element = lambda t: 1 if t.dtype.startswith("F8") else 2  # noqa: E731
    sizes = part_sizes("x", DECODE, tensors, element, r"^blocks\.(\d+)\.")
    assert (sizes.small, sizes.fixed, sizes.blocks) == (8 + 2, 40, (64, 32))


@pytest.mark.cpu_dtype
def test_info_prints_the_plan_of_a_full_size_checkpoint_before_loading(full_size, capsys):
    """On this CPU: the plan for a 24 GiB GPU from the headers; loading the header-only weights then
    fails as a one-line error (the plan came first)."""
    spec, _ = full_size
    assert main(["info", "--model", str(spec.directory), "--gpu-memory", "24GiB"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("GPU memory plan for 24.0 GiB (1024x1024, 1 image, true CFG")
    assert "transformer:" in out and "GB per step" in out and "per request" in out
    assert "GB of weights wait in pinned host memory" in out
    assert err.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-memory", "2GiB"], "GPU memory 2.0 GiB cannot hold this model"),
        (["--gpu-memory", "lots"], "GPU memory 'lots' is not a size"),
        (["--gpu-memory", "24GiB", "--gpus", "2"], "--gpu-memory does not combine with several GPUs"),
    ],
)
def test_a_budget_that_cannot_work_is_refused_in_one_line_before_torch(full_size, args, message):
    spec, _ = full_size
    code = (
        "import sys; from qwen_image_fusion.ui.cli import main; code = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "generate", "a fox", "--model", str(spec.directory), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_the_activation_estimates_bound_what_a_trace_allocates():
    """The planner's activations are at least the bytes a fake-tensor trace of each phase allocates
    (bench/activation_memory.py): the embedded default's three components, and the full-width
    transformer (one block: a step's peak is one block's)."""
    spec = inspect_checkpoint(None)
    act = spec.family.memory_profile(spec, 2, 2).activations
    configs = {name: read_json(spec.directory / name / "config.json") for name in ("transformer", "vae")}
    transformer = QwenImageConfig.from_dict(configs["transformer"])
    text = Qwen2_5_VLConfig.from_pretrained(spec.directory / "text_encoder")
    for side, tokens in ((256, 64), (512, 300)):
        traced = transformer_peak(transformer, side, tokens)
        assert act.step(Workload(side, side, text_tokens=tokens)) >= traced
    assert act.encode(Workload(256, 256)) >= text_encoder_peak(text, MAX_SEQUENCE_LENGTH + DROP_TOKENS + 5)
    for tiled in (False, True):  # 320 px: four of diffusers' 256 px tiles
        assert act.decode(Workload(320, 320), tiled) >= decode_peak(configs["vae"], 320, tiled)
    full = QwenImageActivations(text_hidden=3584, width=3072, vae_base=96, vae_scale=8, dtype_bytes=2)
    traced = transformer_peak(QwenImageConfig(num_layers=1), 1024, 128)
    assert traced <= full.step(Workload(1024, 1024, text_tokens=128)) <= 1.25 * traced


class _PlansNoMemory(QwenImageFamily):
    """A family as the seam allows one: it leaves `memory_profile` at the base's None."""

    def memory_profile(self, spec, dtype_bytes, vae_dtype_bytes):
        return None


def test_a_family_that_plans_no_memory_refuses_a_budget_and_loads_without_one():
    spec = dataclasses.replace(inspect_checkpoint(None), family=_PlansNoMemory())
    args = argparse.Namespace(dtype=None)
    with pytest.raises(
        InputError, match=r"qwen-image family does not plan GPU memory yet: .*\(--gpu-memory\)"
    ):
        gpu_memory_plan(args, spec, 24 * GiB, Workload(1024, 1024))
    with pytest.raises(InputError, match="does not plan GPU memory yet: leave out the budget"):
        plan_for(spec, torch.float32, torch.float32, torch.device("cpu"), "1GiB", None)
    assert plan_for(spec, torch.bfloat16, torch.bfloat16, torch.device("cuda"), None, None) is None


def test_a_batch_is_planned_at_its_rows_but_decoded_a_request_at_a_time(full_size):
    """`Pipeline.run` decodes each request of a batch alone: the plan checks the batch's rows in every
    transformer call and one request's images in decoding, so a batch need not decode in tiles where one
    request's images fit whole (the H200's 24 GiB server test: four 512x512 rows, one image a request)."""
    _, profile = full_size
    plan = plan_memory(profile, 24 * GiB, Workload(512, 512, images=4))
    batch = Workload(512, 512, images=4, text_tokens=512)
    per_request = dataclasses.replace(batch, decode_images=1)
    assert with_workload(plan, profile, batch).tiled_decode
    decoded_alone = with_workload(plan, profile, per_request)
    assert not decoded_alone.tiled_decode
    assert decoded_alone.peaks["denoise"] == with_workload(plan, profile, batch).peaks["denoise"]
