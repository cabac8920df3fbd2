"""Step caching, opt-in and approximate: DBCache / First-Block-Cache (cache-dit, diffusers' FBCache) for a
family's block loop (`run_blocks`), including inside a CUDA-graph step.

Each transformer call runs its first `front_blocks` blocks; their residual (image rows out minus in) is
compared with the one of the last call that ran every block. Where it changed by less than the preset's
threshold, the middle blocks are not run and the middle's last residual (per stream: image and text rows)
is added instead; the last `back_blocks` always run. Decided per batch row, so a request's bytes do not
depend on its companions in a batch; one `BranchCache` per CFG branch, made active around each of that
branch's calls (`caching`). The same steps are skipped in fused and unfused FP8 (their bytes are equal, so
are their decisions).

The decision is a host read of a [rows] tensor, which a CUDA-graph capture cannot hold: while a capture
is in progress (`branch_points`) the decision is a branch point, where the capture ends a graph, captures
both ways (the middle blocks, or the residual), and each replay reads the metric and replays one way.
Both ways write the same output buffers, which the back blocks read.

Under a memory plan that brings blocks in from host memory at every call, the cache's `BlockSchedule` (the
transformer's placement, models/streaming.py) is told which blocks a call leaves out, so the copies stay
in order and none is made for a skipped block that was not already under way; at a branch point it ends
the graph before the decision with its copies joined and begins each way, and the back blocks, afresh.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch

from qwen_image_fusion.models.cache_presets import CachePreset
from qwen_image_fusion.models.errors import InputError

Streams = tuple[torch.Tensor, ...]  # the block loop's carried tensors, image rows first
RunBlock = Callable[[int, Streams], Streams]  # block i over the streams
Decide = Callable[[], bool]  # True: some row runs the middle blocks
BranchPoint = Callable[[Decide, Callable[[], None], Callable[[], None]], None]


class BlockSchedule(Protocol):
    """What moves a call's blocks in and out (a memory plan's placement), told what a cache changes."""

    def skip_blocks(self, start: int, stop: int) -> None:
        """Blocks `start`..`stop`-1 do not run in this call."""

    def cut(self) -> None:
        """A CUDA graph ends in the middle of a call."""

    def resume(self) -> None:
        """The next CUDA graph of the call begins."""


_ACTIVE: ContextVar["BranchCache | None"] = ContextVar("step_cache", default=None)
_BRANCH: ContextVar[BranchPoint | None] = ContextVar("step_cache_branch", default=None)
_WARMING_UP: ContextVar[bool] = ContextVar("step_cache_warm_up", default=False)
_OWNER: ContextVar[object | None] = ContextVar("step_cache_owner", default=None)


class _Buffers:
    """One input shape's persistent tensors (a CUDA graph keeps their addresses)."""

    def __init__(self, streams: Streams) -> None:
        rows, device = streams[0].shape[0], streams[0].device
        self.front_residual = torch.zeros_like(streams[0])  # of the last call that ran the middle
        self.middle_residuals = [torch.zeros_like(s) for s in streams]
        self.outputs = [torch.empty_like(s) for s in streams]  # where both ways write
        self.metric = torch.zeros(rows, dtype=torch.float32, device=device)
        self.compute_rows = torch.ones(rows, dtype=torch.bool, device=device)


class BranchCache:
    """One CFG branch's cache: per-shape buffers, and per row the skip counts of the current loop."""

    def __init__(self, preset: CachePreset, schedule: BlockSchedule | None = None) -> None:
        self.preset, self.schedule = preset, schedule
        self.buffers: dict[tuple, _Buffers] = {}  # per owner (a captured graph, None: eager) and shape
        self.reset()

    def reset(self) -> None:
        """A new denoising loop: warm-up again, counts from zero. The buffers stay (graphs hold their
        addresses); their last front residual is zeroed, so no row skips before it has run the middle in
        this loop."""
        for buf in self.buffers.values():
            buf.front_residual.zero_()
        self.calls = 0
        self.in_a_row: list[int] = []
        self.skipped: list[int] = []

    def forget(self, owner: object | None) -> None:
        """Let go of the buffers `owner` (a captured graph that is dropped; None: eager calls) made."""
        self.buffers = {key: buf for key, buf in self.buffers.items() if key[0] != owner}

    def run(self, count: int, streams: Streams, run: RunBlock) -> Streams:
        """Blocks 0..count-1 over `streams`, the middle ones skipped in the rows the rule lets skip."""
        p = self.preset
        if p.front_blocks + p.back_blocks >= count:
            raise InputError(
                f"cache {p.name!r}: F{p.front_blocks}B{p.back_blocks} leaves no middle block of {count}"
            )
        before = streams[0]
        for i in range(p.front_blocks):
            streams = run(i, streams)
        owner = _OWNER.get()
        key = (owner, *((s.shape, s.dtype, s.device) for s in streams))
        if key not in self.buffers:
            if streams[0].is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a step cache's buffers are made in the warm-up call, not in a capture")
            if owner is None:  # eager calls hold no addresses: only the current shape's buffers stay
                self.forget(None)
            self.buffers[key] = _Buffers(streams)
        buf, front = self.buffers[key], streams
        front_residual = front[0] - before
        buf.metric.copy_(relative_change(front_residual, buf.front_residual))

        def middle() -> None:
            out = front
            for i in range(p.front_blocks, count - p.back_blocks):
                out = run(i, out)
            keep = buf.compute_rows.view(-1, *([1] * (front[0].dim() - 1)))
            remember = not _WARMING_UP.get()  # a warm-up call leaves the cache as it found it
            for f, o, res, dst in zip(front, out, buf.middle_residuals, buf.outputs, strict=True):
                dst.copy_(torch.where(keep, o, f + res))
                if remember:
                    res.copy_(torch.where(keep, o - f, res))
            if remember:
                buf.front_residual.copy_(torch.where(keep, front_residual, buf.front_residual))

        def reuse() -> None:
            if self.schedule is not None:
                self.schedule.skip_blocks(p.front_blocks, count - p.back_blocks)
            for f, res, dst in zip(front, buf.middle_residuals, buf.outputs, strict=True):
                dst.copy_(f + res)

        branch = _BRANCH.get()
        if branch is None:
            (middle if self.decide(buf) else reuse)()
        elif self.schedule is None:
            branch(lambda: self.decide(buf), middle, reuse)
        else:
            self._scheduled_branch(branch, lambda: self.decide(buf), middle, reuse)
        streams = tuple(buf.outputs)
        for i in range(count - p.back_blocks, count):
            streams = run(i, streams)
        return streams

    def _scheduled_branch(
        self, branch: BranchPoint, decide: Decide, middle: Callable[[], None], reuse: Callable[[], None]
    ) -> None:
        """`branch` with the schedule cut before the decision and resumed in each way and after both."""
        schedule = self.schedule

        def resumed(way: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                schedule.resume()
                way()
                schedule.cut()

            return run

        schedule.cut()
        branch(decide, resumed(middle), resumed(reuse))
        if self.preset.back_blocks:
            schedule.resume()

    def decide(self, buf: _Buffers) -> bool:
        """Which rows run the middle blocks this call (into `buf.compute_rows`); True if any does."""
        rows = buf.metric.shape[0]
        if _WARMING_UP.get():
            buf.compute_rows.fill_(True)
            return True
        if len(self.in_a_row) != rows:
            self.in_a_row, self.skipped = [0] * rows, [0] * rows
        p, call = self.preset, self.calls
        self.calls += 1
        if call < p.warmup_steps:
            compute = [True] * rows
        else:
            metric = buf.metric.tolist()  # the host sync: the decision
            compute = [
                not (m < p.threshold) or n >= p.max_cached_in_a_row
                for m, n in zip(metric, self.in_a_row, strict=True)
            ]
        for r, c in enumerate(compute):
            self.in_a_row[r] = 0 if c else self.in_a_row[r] + 1
            self.skipped[r] += not c
        buf.compute_rows.copy_(torch.tensor(compute), non_blocking=False)
        return any(compute)


def relative_change(residual: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Per row: mean |residual - previous| / mean |previous| in FP32 (inf or nan, never below a threshold,
    where `previous` is zero)."""
    dims = tuple(range(1, residual.dim()))
    change = (residual - previous).abs().mean(dim=dims, dtype=torch.float32)
    return change / previous.abs().mean(dim=dims, dtype=torch.float32)


def run_blocks(count: int, streams: Streams, run: RunBlock) -> Streams:
    """Blocks 0..count-1 over `streams` in order (`run(i, streams)`), or through the active step cache."""
    cache = _ACTIVE.get()
    if cache is None:
        for i in range(count):
            streams = run(i, streams)
        return streams
    return cache.run(count, streams, run)


@contextmanager
def caching(cache: BranchCache | None) -> Iterator[None]:
    """Run the transformer calls inside with `cache` (None: every block runs)."""
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def branch_points(branch: BranchPoint) -> Iterator[None]:
    """While a CUDA graph captures: hand each decision to `branch(decide, middle, reuse)` instead."""
    token = _BRANCH.set(branch)
    try:
        yield
    finally:
        _BRANCH.reset(token)


@contextmanager
def owned_by(owner: object) -> Iterator[None]:
    """The buffers a cache makes inside belong to `owner` (a captured graph: its key), which lets go of
    them with `BranchCache.forget` when it goes; each graph has its own, whatever their shapes."""
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)


@contextmanager
def warming_up() -> Iterator[None]:
    """A CUDA graph's warm-up call: every block runs and nothing is counted (the replay that follows is
    the real call)."""
    token = _WARMING_UP.set(True)
    try:
        yield
    finally:
        _WARMING_UP.reset(token)
