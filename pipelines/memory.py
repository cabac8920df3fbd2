"""A memory plan (pipelines/memory_plan.py) applied to a loaded model: each component placed on the device
as the plan says (models/streaming.py), the text encoder brought in for encoding and prefetched after each
request, the VAE tiled when a request needs it, and the plan kept true when LoRAs change the weights.
Family-neutral: components are the family model's by the names its memory profile gives."""

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import CheckpointSpec, FamilyModel
from qwen_image_fusion.models.memory import DECODE, MemoryProfile, PartSizes, Workload
from qwen_image_fusion.models.streaming import Link, PlacedWeights, link_for, moving_tensors, still_bytes
from qwen_image_fusion.pipelines.cuda_graph import cuda_graphs_enabled_by_env
from qwen_image_fusion.pipelines.memory_plan import (
    OFFLOAD,
    RESERVE_BYTES,
    MemoryPlan,
    checkpoint_plan,
    gib,
    parse_size,
    phase_peaks,
    plan_memory,
    with_workload,
)

DTYPE_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def budget_bytes(gpu_memory: int | str) -> int:
    """A budget given as bytes or as a size such as "24GiB" (InputError otherwise)."""
    if isinstance(gpu_memory, int) and not isinstance(gpu_memory, bool):
        if gpu_memory <= 0:
            raise InputError(f"GPU memory {gpu_memory} bytes must be above zero")
        return gpu_memory
    return parse_size(gpu_memory)


def plan_for(
    spec: CheckpointSpec,
    dtype: torch.dtype,
    vae_dtype: torch.dtype,
    device: torch.device,
    gpu_memory: int | str | None,
    workload: Workload | None,
) -> tuple[MemoryProfile, MemoryPlan] | None:
    """The memory plan a pipeline loads with: on CUDA always (default budget: what the device has free),
    on a CPU only for an explicit budget; None otherwise, or when the family plans no memory. An explicit
    budget on CUDA also caps this process's allocations there (torch's per-process memory fraction)."""
    budget = None if gpu_memory is None else budget_bytes(gpu_memory)
    if budget is None and device.type != "cuda":
        return None
    sizes = DTYPE_BYTES[dtype], DTYPE_BYTES[vae_dtype]
    if budget is None and spec.family.memory_profile(spec, *sizes) is None:
        return None  # a family that plans no memory: everything loads onto the device
    explicit = budget is not None
    graphs = device.type == "cuda" and cuda_graphs_enabled_by_env()
    fixed = RESERVE_BYTES if device.type == "cuda" else 0
    profile, plan = checkpoint_plan(spec, *sizes, device_budget(device, budget), workload, graphs, fixed)
    check_host_memory(plan)
    if explicit:
        cap_device(device, budget)
    return profile, plan


def device_budget(device: torch.device, budget: int | None) -> int:
    """On CUDA: None becomes what the GPU has free now plus what this process holds there already; an
    explicit budget is refused above what the GPU has. Elsewhere the budget as given."""
    if device.type != "cuda":
        return budget
    free, total = torch.cuda.mem_get_info(device)
    if budget is not None and budget > total:
        raise InputError(f"GPU memory {gib(budget)} is more than the {gib(total)} this GPU has")
    return free + torch.cuda.memory_reserved(device) if budget is None else budget


def host_memory_available() -> int | None:
    """Bytes of host memory available to start new work without swapping (Linux's MemAvailable, which
    counts page cache the kernel can drop, e.g. a checkpoint's file pages), or None where it is unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
    except OSError:
        return None
    value = fields.get("MemAvailable", "").split()
    return int(value[0]) * 1024 if value else None


def check_host_memory(plan: MemoryPlan, held: int = 0) -> None:
    """InputError when the weights `plan` keeps in host memory, beyond the `held` bytes of host copies this
    process has already, exceed what the host has available."""
    check_host_room(
        plan.host_bytes - held,
        f"the {gib(plan.budget)} GPU memory plan keeps {{}} more weights in host memory",
        "give a larger GPU memory budget (less waits on the host) or free host memory",
    )


def check_host_room(needed: int, keeps: str, remedy: str) -> None:
    """InputError when `needed` more bytes of host memory exceed what the host has available (else the
    kernel would stop the process with no message); `keeps` says what takes them, with {} for the size."""
    available = host_memory_available()
    if available is not None and needed > available:
        raise InputError(
            f"{keeps.format(gib(needed))}, but this machine has {gib(available)} available: {remedy}"
        )


def cap_device(device: torch.device, budget: int | None) -> None:
    """On CUDA, an explicit budget caps this process's allocations there (torch's per-process memory
    fraction), so the plan's peaks are enforced, not hoped for; None lifts the cap (`replan`). Blocks the
    caching allocator holds but no tensor uses are released first: the cap counts them, and after a
    re-plan they are the old placement's and graph pools' sizes, which the new one cannot reuse."""
    if device.type == "cuda":
        if budget is not None:
            expandable_segments()
        torch.cuda.empty_cache()
        index = torch.cuda.current_device() if device.index is None else device.index
        total = torch.cuda.mem_get_info(index)[1]
        torch.cuda.set_per_process_memory_fraction(1.0 if budget is None else budget / total, index)


class GpuMemory:
    """One pipeline's components placed for `plan` on `link`'s device."""

    def __init__(self, model: FamilyModel, profile: MemoryProfile, plan: MemoryPlan, link: Link) -> None:
        self.model, self.profile, self.plan, self.link = model, profile, plan, link
        self.placed: dict[str, PlacedWeights] = {}
        for part in profile.parts:
            module = getattr(model.components, part.name)
            blocks = None if part.block_path is None else module.get_submodule(part.block_path)
            self.placed[part.name] = PlacedWeights(module, blocks, link)

    @classmethod
    def for_model(cls, model: FamilyModel, profile: MemoryProfile, plan: MemoryPlan) -> "GpuMemory":
        """Place a model loaded on the host (or the device) on its compute device as `plan` says."""
        memory = cls(model, profile, plan, link_for(model.device))
        memory.place()
        return memory

    def place(self) -> None:
        """Each component as the plan says; blocks that lend their memory hold at least what the offloaded
        component needs while it runs (placed first, so its need is known)."""
        offloaded = [p for p in self.plan.placements if p.mode == OFFLOAD]
        for placement in (*offloaded, *(p for p in self.plan.placements if p.mode != OFFLOAD)):
            lend = sum(self.placed[p.part.name].phase_bytes for p in offloaded) if placement.lent else 0
            self.placed[placement.part.name].place(
                placement.streamed, placement.slots, placement.mode == OFFLOAD, placement.lent, lend
            )

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Inside, the component of `phase` is on the device (in the memory a lender gave it); after, the
        lender's blocks are copied back."""
        part = self.profile.part(phase)
        placed = self.placed[part.name]
        lender = self._lender() if self.plan.placement(part.name).mode == OFFLOAD else None
        with placed.phase(None if lender is None else lender.lend(placed)):
            yield
        if lender is not None:
            lender.load_lent()

    def prefetch(self) -> None:
        """Start bringing the offloaded components back for the next request (after one has finished)."""
        lender = self._lender()
        for placement in self.plan.placements:
            if placement.mode == OFFLOAD:
                placed = self.placed[placement.part.name]
                placed.prefetch(None if lender is None else lender.lend(placed))

    def _lender(self) -> PlacedWeights | None:
        return next((self.placed[p.part.name] for p in self.plan.placements if p.lent), None)

    def request(self, workload: Workload) -> MemoryPlan:
        """The plan for one request (InputError when it does not fit); sets the VAE's tiling for it."""
        plan = with_workload(self.plan, self.profile, workload)
        vae = getattr(self.model.components, self.profile.part(DECODE).name)
        if plan.tiled_decode:
            vae.enable_tiling()
        else:
            vae.disable_tiling()
        return plan

    def replan(self, gpu_memory: int | str | None, workload: Workload | None = None) -> None:
        """Place the weights for another budget (None: what the device has free) and largest request, in
        place: tensors move between the device and host memory, nothing is read from disk again."""
        explicit = None if gpu_memory is None else budget_bytes(gpu_memory)
        budget = device_budget(self.link.device, explicit)
        plan = self.plan
        new = plan_memory(self.profile, budget, workload or plan.workload, plan.graphs, plan.fixed_reserve)
        check_host_memory(new, held=plan.host_bytes)
        self.plan = new
        self._leave(plan)
        cap_device(self.link.device, explicit)
        self.place()

    def _leave(self, old: MemoryPlan) -> None:
        """Before a new plan is placed: what leaves the device under it leaves first, and nothing else moves
        (the device never holds old and new at once; host memory holds no copy the new plan does not keep).
        Each component streams the blocks either plan keeps off the device, offloaded if either offloads."""
        for new in self.plan.placements:
            before = old.placement(new.part.name)
            away = sorted({*before.streamed, *before.lent, *new.streamed, *new.lent})
            self.placed[new.part.name].place(away, 1 if away else 0, OFFLOAD in (before.mode, new.mode))

    def refresh(self) -> None:
        """After the weights changed (LoRAs, variant): their sizes measured again, the placements kept while
        they still fit the budget (else planned again), and every new tensor put where its block goes."""
        live = replace(self.profile, parts=tuple(self._live_sizes(p) for p in self.profile.parts))
        placements = tuple(replace(p, part=live.part(p.part.phase)) for p in self.plan.placements)
        peaks = phase_peaks(live, placements, self.plan.workload, self.plan.tiled_decode, self.plan.graphs)
        if self.plan.fits(peaks):
            self.plan = replace(self.plan, placements=placements, peaks=peaks)
        else:
            plan = self.plan
            self.plan = plan_memory(live, plan.budget, plan.workload, plan.graphs, plan.fixed_reserve)
        self.profile = live
        self.place()
        if self.link.device.type == "cuda":
            # what the old slots, lent buffer and graphs held stays reserved and counts against the cap,
            # and buffers grown by a LoRA do not fit in it
            torch.cuda.empty_cache()

    def _live_sizes(self, part: PartSizes) -> PartSizes:
        """`part`'s sizes from the tensors it holds now (LoRA factors included)."""
        placed = self.placed[part.name]
        blocks = [] if placed.blocks is None else list(placed.blocks)

        def size(tensors) -> int:
            return sum(m.nbytes for m in tensors)

        small = still_bytes(placed.root)
        block_bytes = tuple(size(moving_tensors(block)) for block in blocks)
        return replace(
            part, small=small, fixed=size(moving_tensors(placed.root, skip=blocks)), blocks=block_bytes
        )

    def describe(self) -> list[str]:
        return self.plan.describe()


@contextmanager
def in_phase(memory: GpuMemory | None, phase: str) -> Iterator[None]:
    """`memory.phase(phase)`, or nothing without a memory plan."""
    with nullcontext() if memory is None else memory.phase(phase):
        yield


def expandable_segments() -> None:
    """Let torch's caching allocator grow one segment per stream and unmap the free pages inside it (torch's
    `expandable_segments`), from now on in this process. Under a cap, fixed-size segments strand memory:
    small long-lived tensors (LoRA factors, rebuilt on every LoRA change) pin 20 MiB segments that
    activations cannot use; on the H200 at 24 GiB 2.7 GiB sat so, and a LoRA step ran out of memory."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9 has only the cuda-specific setter
        setter = torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
