"""The GPU-memory planner (torch-free): where each component's weights live for a budget, a pure function of
the components' sizes (models/memory.py), the budget and the largest request the plan must hold.

In order of cost, the first that fits wins:
1. everything resident;
2. the text encoder on the device only while it encodes (a pinned host copy, loaded back asynchronously
   after each request so that the next one finds it there);
3. that, with transformer blocks streamed from pinned host memory on a side stream one block ahead of
   compute (`prefetch`), as many blocks resident as the budget allows, the streamed ones spread evenly;
   the text encoder streams its layers too when even its whole copy does not fit beside them.
Among plans that fit, the one moving the fewest bytes per denoising step wins, then per request. Each phase
(encoding, denoising, decoding) must fit: the weights on the device then, plus its activations, plus the
pools of the captured CUDA graphs and the buffers the steps keep (one of each per CFG branch, kept across
phases, e.g. a KV cache of the prompt and condition images), plus a reserve for the CUDA libraries'
workspaces and the allocator's rounding. The VAE decodes in tiles when whole images do not fit.
"""

import math
import re
from dataclasses import dataclass, field, replace

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import CheckpointSpec
from qwen_image_fusion.models.memory import DECODE, DENOISE, ENCODE, MemoryProfile, PartSizes, Workload

GiB = 1024**3
UNITS = {
    "": GiB,  # a bare number is GiB, what nvidia-smi and the cards' spec sheets mean
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": GiB,
    "tib": 1024**4,
}
RESERVE_BYTES = 768 * 1024**2  # cuBLAS/cuDNN workspaces, CUDA-graph bookkeeping
RESERVE_FRACTION = 0.04  # the caching allocator's rounding and fragmentation
PREFETCH = 1  # blocks loaded ahead of the one computing: slots = PREFETCH + 1
RESIDENT, OFFLOAD, STREAM = "resident", "offload", "stream"


def parse_size(text: str) -> int:
    """Bytes of a size such as "24GiB", "24GB", "24 GiB" or "24" (GiB); InputError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = None if match is None else UNITS.get(match.group(2).lower())
    if unit is None:
        raise InputError(f"GPU memory {text!r} is not a size: use e.g. 24GiB, 24GB or 16000MiB")
    size = round(float(match.group(1)) * unit)
    if size <= 0:
        raise InputError(f"GPU memory {text!r} must be above zero")
    return size


def gib(size: int) -> str:
    """A size as people read it: GiB with one decimal, MiB below one GiB."""
    return f"{size / GiB:.1f} GiB" if size >= GiB else f"{size / 1024**2:.0f} MiB"


def reserve(budget: int, fixed: int = RESERVE_BYTES) -> int:
    """What a budget keeps free of weights and activations (`fixed`: the CUDA libraries' part, none on a
    CPU)."""
    return fixed + round(RESERVE_FRACTION * budget)


@dataclass(frozen=True)
class Placement:
    """Where one component's weights live: `resident`; `offload` (on the device only in its phase, its
    `streamed` blocks copied one at a time through `slots` buffers meanwhile); `stream` (on the device
    always, but its `streamed` blocks, which are copied in through `slots` buffers at every call). A
    streaming component's `lent` blocks stay in one fixed buffer that it lends to the offloaded one while
    that one runs, and are copied back once per request."""

    part: PartSizes
    mode: str
    streamed: tuple[int, ...] = ()
    slots: int = 0
    lent: tuple[int, ...] = ()

    @property
    def streamed_bytes(self) -> int:
        return sum(self.part.blocks[i] for i in self.streamed)

    @property
    def lent_bytes(self) -> int:
        return sum(self.part.blocks[i] for i in self.lent)

    @property
    def slot_bytes(self) -> int:
        return self.slots * max((self.part.blocks[i] for i in self.streamed), default=0)

    @property
    def host_bytes(self) -> int:
        """Bytes of this component's weights that wait in pinned host memory."""
        if self.mode == OFFLOAD:
            return self.part.fixed + sum(self.part.blocks)
        return self.streamed_bytes + self.lent_bytes

    @property
    def moving_bytes(self) -> int:
        """Bytes of this component copied to the device once per request."""
        return self.host_bytes if self.mode == OFFLOAD else self.lent_bytes

    def always(self) -> int:
        """Device bytes outside its phase."""
        if self.mode == OFFLOAD:
            return self.part.small
        return self.part.total - self.streamed_bytes + self.slot_bytes

    def during(self) -> int:
        """Device bytes while it runs."""
        if self.mode == OFFLOAD:
            return self.part.total - self.streamed_bytes + self.slot_bytes
        return self.always()

    def brief(self) -> str:
        """A few words: "text encoder offloaded", "transformer 18/60 blocks streamed, 7 lent to ..."."""
        name = self.part.name.replace("_", " ")
        blocks = f"{len(self.streamed)}/{len(self.part.blocks)} blocks streamed" if self.streamed else ""
        lent = f"{len(self.lent)} lent to the text encoder" if self.lent else ""
        if self.mode == OFFLOAD:
            return f"{name} offloaded" + (f" ({blocks})" if blocks else "")
        return f"{name} " + ", ".join(filter(None, (blocks, lent)))

    def describe(self) -> str:
        name = self.part.name.replace("_", " ")
        blocks = len(self.part.blocks)
        ahead = f"{self.slots - 1} block{'s' if self.slots > 2 else ''} ahead"
        if self.mode == RESIDENT:
            return f"{name}: resident ({self.part.total / 1e9:.2f} GB)"
        if self.mode == OFFLOAD:
            streamed = (
                f", {len(self.streamed)} of its {blocks} blocks streamed {ahead}" if self.streamed else ""
            )
            return (
                f"{name}: on the device only while it runs{streamed}; "
                f"{self.moving_bytes / 1e9:.2f} GB copied from pinned host memory per request"
            )
        lent = (
            f", {len(self.lent)} of them lending their memory to the text encoder and copied back per request"
            if self.lent
            else ""
        )
        streamed = (
            f"; {len(self.streamed)} streamed from pinned host memory {ahead} "
            f"({self.streamed_bytes / 1e9:.2f} GB per call)"
            if self.streamed
            else ""
        )
        return f"{name}: {blocks - len(self.streamed)} of {blocks} blocks resident{lent}{streamed}"


@dataclass(frozen=True)
class MemoryPlan:
    """A placement of every component for a budget and a workload, with the peaks it expects."""

    budget: int
    workload: Workload
    placements: tuple[Placement, ...]
    tiled_decode: bool
    graphs: bool  # CUDA graphs capture the transformer call (their pools stay allocated)
    peaks: dict[str, int] = field(default_factory=dict, compare=False)
    fixed_reserve: int = RESERVE_BYTES

    @property
    def reserve(self) -> int:
        return reserve(self.budget, self.fixed_reserve)

    def fits(self, peaks: dict[str, int]) -> bool:
        return max(peaks.values()) + self.reserve <= self.budget

    def placement(self, name: str) -> Placement:
        return next(p for p in self.placements if p.part.name == name)

    @property
    def resident(self) -> bool:
        return all(p.mode == RESIDENT for p in self.placements)

    @property
    def calls_per_step(self) -> int:
        return 2 if self.workload.true_cfg else 1

    @property
    def bytes_per_step(self) -> int:
        """Host-to-device bytes of one denoising step (every CFG branch's transformer call)."""
        return sum(p.streamed_bytes for p in self.placements if p.part.phase == DENOISE) * self.calls_per_step

    @property
    def bytes_per_request(self) -> int:
        """Host-to-device bytes once per request (components on the device only in their phase, blocks
        that lent them their memory)."""
        return sum(p.moving_bytes for p in self.placements)

    @property
    def host_bytes(self) -> int:
        """Bytes of weights this plan keeps in pinned host memory (a LoRA in merge mode adds the original
        weights of the layers it changes)."""
        return sum(p.host_bytes for p in self.placements)

    def summary(self) -> str:
        """One line: what moves and how much (the generate summary)."""
        moving = ", ".join(p.brief() for p in self.placements if p.mode != RESIDENT) or "everything resident"
        decode = ", tiled decoding" if self.tiled_decode else ""
        return (
            f"{gib(self.budget)} plan: {moving}{decode}; from pinned host memory "
            f"{self.bytes_per_step / 1e9:.2f} GB per step, {self.bytes_per_request / 1e9:.2f} GB per request"
        )

    def describe(self) -> list[str]:
        """Lines for `qwen-image info --gpu-memory` and the generate summary."""
        decode = (
            "VAE decodes in tiles (whole images do not fit)" if self.tiled_decode else "VAE decodes whole"
        )
        peaks = ", ".join(f"{phase} {gib(size)}" for phase, size in self.peaks.items())
        return [
            f"GPU memory plan for {gib(self.budget)} ({self.workload.describe()}):",
            *(f"  {p.describe()}" for p in self.placements),
            f"  {decode}",
            f"  host to device: {self.bytes_per_step / 1e9:.2f} GB per step, "
            f"{self.bytes_per_request / 1e9:.2f} GB per request",
            f"  expected peaks: {peaks}, plus {gib(self.reserve)} kept free",
            f"  host memory: {self.host_bytes / 1e9:.2f} GB of weights wait in pinned host memory (a LoRA "
            "in merge mode adds the original weights of the layers it changes)",
        ]


def evenly(count: int, blocks: int) -> tuple[int, ...]:
    """`count` of `blocks` indices spread evenly, the last block included and the first ones kept, so the
    first streamed block's copy overlaps the compute of the blocks before it."""
    return tuple(blocks - 1 - math.floor(i * blocks / count) for i in range(count))[::-1] if count else ()


def place_part(part: PartSizes, mode: str, resident_blocks: int, lend: int = 0) -> Placement:
    """`part` with `resident_blocks` of its blocks kept (the others streamed through PREFETCH + 1 slots),
    the last of them that together hold at least `lend` bytes lent to the offloaded component."""
    streamed = evenly(len(part.blocks) - resident_blocks, len(part.blocks))
    kept = [i for i in range(len(part.blocks)) if i not in streamed]
    lent: list[int] = []
    while kept and sum(part.blocks[i] for i in lent) < lend:
        lent.insert(0, kept.pop())
    return Placement(part, mode, streamed, PREFETCH + 1 if streamed else 0, tuple(lent))


def phase_peaks(
    profile: MemoryProfile,
    placements: tuple[Placement, ...],
    workload: Workload,
    tiled: bool,
    graphs: bool,
) -> dict[str, int]:
    """Device bytes each phase needs at most: weights there then, activations, graph pools and the buffers
    the steps keep, reserve excluded."""
    act = profile.activations
    step = act.step(workload)
    branches = 2 if workload.true_cfg else 1
    cache = branches * act.step_cache(workload) if workload.step_cache else 0
    pools = (branches * step if graphs else 0) + act.held(workload) + cache
    always = sum(p.always() for p in placements)
    extra = {p.part.phase: p.during() - p.always() for p in placements}
    lent = sum(p.lent_bytes for p in placements)  # the offloaded component's buffer, while it runs
    extra[ENCODE] = max(0, extra.get(ENCODE, 0) - lent)
    return {
        ENCODE: always + extra.get(ENCODE, 0) + act.encode(workload) + pools,
        # one more call: while a graph is captured, or a branch's first step
        DENOISE: always + extra.get(DENOISE, 0) + pools + max(step, act.first_step(workload)),
        DECODE: always + extra.get(DECODE, 0) + act.decode(workload, tiled) + pools,
    }


def default_workload(spec: CheckpointSpec) -> Workload:
    """The request a plan holds unless told otherwise: the checkpoint's default size, one image, true CFG;
    as many input images as a request may carry where the model needs them, none where they are optional
    (condition images: a request with some is checked against the plan when it comes)."""
    inputs = spec.max_images if spec.images_required else 0
    return Workload(spec.defaults.width, spec.defaults.height, input_images=inputs)


def checkpoint_plan(
    spec: CheckpointSpec,
    dtype_bytes: int,
    vae_dtype_bytes: int,
    budget: int,
    workload: Workload | None = None,
    graphs: bool = True,
    fixed_reserve: int = RESERVE_BYTES,
) -> tuple[MemoryProfile, MemoryPlan]:
    """The memory profile of `spec`'s checkpoint (its components at `dtype_bytes` per element, the VAE at
    `vae_dtype_bytes`) and its plan for `budget` and `workload` (default: `default_workload`): what the
    pipeline loads with and what the CLI checks before loading. InputError where the family plans no
    memory, or where nothing fits."""
    profile = spec.family.memory_profile(spec, dtype_bytes, vae_dtype_bytes)
    if profile is None:
        raise InputError(
            f"the {spec.family.name} family does not plan GPU memory yet: leave out the budget (--gpu-memory)"
        )
    return profile, plan_memory(profile, budget, workload or default_workload(spec), graphs, fixed_reserve)


def plan_memory(
    profile: MemoryProfile,
    budget: int,
    workload: Workload,
    graphs: bool = True,
    fixed_reserve: int = RESERVE_BYTES,
) -> MemoryPlan:
    """The cheapest placement that fits `budget` bytes for `workload`; InputError naming the smallest
    budget that would work when none does. `graphs`: the transformer call is captured in CUDA graphs;
    `fixed_reserve`: what the CUDA libraries need besides (0 on a CPU)."""
    plan = _cheapest(profile, MemoryPlan(budget, workload, (), False, graphs, fixed_reserve=fixed_reserve))
    if plan is None:
        need = minimum_budget(profile, workload, graphs, fixed_reserve)
        raise InputError(
            f"GPU memory {gib(budget)} cannot hold this model for {workload.describe()}: it needs at least "
            f"{gib(need)}"
        )
    return plan


def _cheapest(profile: MemoryProfile, empty: MemoryPlan) -> MemoryPlan | None:
    """For each way of holding the text encoder, the plan keeping the most transformer blocks resident;
    of those, the one moving the fewest bytes per step, then per request (None when none fits)."""
    text, transformer, vae = (profile.part(phase) for phase in (ENCODE, DENOISE, DECODE))
    options = [place_part(text, RESIDENT, len(text.blocks))]
    options += [place_part(text, OFFLOAD, k) for k in range(len(text.blocks), -1, -1)]
    plans = [
        _best_transformer(profile, empty, option, transformer, vae, lend)
        for option in options
        for lend in (False, option.mode == OFFLOAD)
    ]
    plans = [plan for plan in plans if plan is not None]
    return min(plans, key=lambda p: (p.bytes_per_step, p.tiled_decode, p.bytes_per_request), default=None)


def _best_transformer(
    profile: MemoryProfile,
    empty: MemoryPlan,
    text: Placement,
    transformer: PartSizes,
    vae: PartSizes,
    lend: bool = False,
) -> MemoryPlan | None:
    """The plan with `text` keeping the most transformer blocks resident, decoding whole if it can (fewer
    resident blocks never need more memory, so a bisection finds the most); with `lend`, resident blocks
    that hold the offloaded text encoder's buffer lend it their memory while it runs."""
    blocks = len(transformer.blocks)
    need = text.during() - text.always() if lend else 0

    def plan(resident: int, tiled: bool) -> MemoryPlan | None:
        mode = RESIDENT if resident == blocks and not need else STREAM
        placements = (text, place_part(transformer, mode, resident, need), Placement(vae, RESIDENT))
        peaks = phase_peaks(profile, placements, empty.workload, tiled, empty.graphs)
        return (
            replace(empty, placements=placements, tiled_decode=tiled, peaks=peaks)
            if empty.fits(peaks)
            else None
        )

    best = []
    for tiled in (False, True):  # the most resident blocks each way; whole decoding breaks a tie
        found = plan(blocks, tiled)  # all resident needs no slots: checked on its own
        low, high = -1, blocks - 1  # plan(low) fits (or low is -1), plan(high + 1) does not
        while found is None and low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if plan(middle, tiled) is not None else (low, middle - 1)
        found = found or (plan(low, tiled) if low >= 0 else None)
        best += [found] if found is not None else []
    return min(best, key=lambda p: (p.bytes_per_step, p.tiled_decode), default=None)


def minimum_budget(
    profile: MemoryProfile, workload: Workload, graphs: bool = True, fixed_reserve: int = RESERVE_BYTES
) -> int:
    """The smallest budget some plan fits, to 1 MiB (a plan that fits a budget fits every larger one)."""
    low, high = 0, 1024**2

    def fits(budget: int) -> bool:
        empty = MemoryPlan(budget, workload, (), False, graphs, fixed_reserve=fixed_reserve)
        return _cheapest(profile, empty) is not None

    while not fits(high):
        low, high = high, 2 * high
    while high - low > 1024**2:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def with_workload(plan: MemoryPlan, profile: MemoryProfile, workload: Workload) -> MemoryPlan:
    """`plan`'s placements for another request: its peaks and whether it decodes in tiles; InputError when
    the request does not fit the budget with these placements (the plan was made for a smaller one)."""
    for tiled in (False, True):
        peaks = phase_peaks(profile, plan.placements, workload, tiled, plan.graphs)
        if plan.fits(peaks):
            return replace(plan, workload=workload, tiled_decode=tiled, peaks=peaks)
    raise InputError(
        f"this request ({workload.describe()}) needs more than the {gib(plan.budget)} of GPU memory the "
        f"model was placed for ({plan.workload.describe()}): make it smaller, or load with that request "
        "as the largest one"
    )
