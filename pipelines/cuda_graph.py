"""CUDA-graph replay of the transformer step: one capture per input signature, then replays.

The step has no host synchronisation (tests guard it), so the whole 60-block forward can be captured
once and replayed, removing thousands of kernel launches per step. Replays run the same kernels on
the same data as eager execution; the variant switch drops all captured graphs.

Under Ulysses the step holds collectives (two all-to-alls per block and one gather). By default the
capture is cut at each of them: the segments between collectives are graphs sharing one memory pool,
and the collectives run eagerly between their replays, where NCCL's watchdog sees them (its timeout
ends a run whose peer died). QWEN_IMAGE_GRAPH_COLLECTIVES=capture captures the collectives inside the
graph instead: fewer launches, but a replayed collective is not watched, so only the launcher ends a
run whose peer died. bench/parallel_bench.py measures both.
"""

import os
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from qwen_image_fusion.models.env import env_flag
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.sequence_parallel import Collective, cut_at_collectives
from qwen_image_fusion.models.step_cache import BranchCache, branch_points, caching, owned_by, warming_up

GRAPHS_ENV = "QWEN_IMAGE_CUDA_GRAPHS"
COLLECTIVES_ENV = "QWEN_IMAGE_GRAPH_COLLECTIVES"
MAX_GRAPHS = 4  # cond and negative branch of two prompt lengths
T = TypeVar("T")


def cuda_graphs_enabled_by_env() -> bool:
    """`QWEN_IMAGE_CUDA_GRAPHS=0` turns capture off (eager steps)."""
    return env_flag(GRAPHS_ENV)


def cut_collectives_by_env() -> bool:
    """QWEN_IMAGE_GRAPH_COLLECTIVES: `segments` (default) cuts graphs at collectives, `capture` keeps them."""
    mode = os.environ.get(COLLECTIVES_ENV, "segments").strip().lower()
    if mode not in ("segments", "capture"):
        raise InputError(f"{COLLECTIVES_ENV}={mode!r} must be 'segments' or 'capture'")
    return mode == "segments"


class GraphSegments:
    """A function captured as CUDA graphs cut at its collectives; replay runs the graphs in order, each
    cut's collective between its two segments. With no collective (or `cut=False`) it is one graph."""

    def __init__(self, new_graph: Callable[[], Any], pool: Any, capture_error_mode: str = "global") -> None:
        self.new_graph, self.pool, self.mode = new_graph, pool, capture_error_mode
        self.pieces: list[tuple[Any, Collective | None]] = []

    def capture(self, fn: Callable[[], T], cut: bool = True) -> T:
        """Capture `fn()` (on the current, non-default stream) and return its output tensors."""
        self._begin()
        try:
            with cut_at_collectives(self._cut) if cut else nullcontext(), branch_points(self._branch):
                out = fn()
        finally:
            self._graph.capture_end()
        self.pieces.append((self._graph, None))
        return out

    def replay(self) -> None:
        for graph, collective in self.pieces:
            graph.replay()
            if collective is not None:
                collective()

    def _branch(
        self, decide: Callable[[], bool], middle: Callable[[], None], reuse: Callable[[], None]
    ) -> None:
        """A step cache's decision (models/step_cache.py): both ways captured, one replayed per call."""
        self._graph.capture_end()
        self.pieces.append((self._graph, None))
        ways = []
        for way in (middle, reuse):
            self._begin()
            try:
                way()
            finally:
                self._graph.capture_end()
            ways.append(self._graph)
        self.pieces.append((_Branch(decide, *ways), None))
        self._begin()

    def _begin(self) -> None:
        self._graph = self.new_graph()
        self._graph.capture_begin(self.pool, capture_error_mode=self.mode)

    def _cut(self, collective: Collective) -> None:
        self._graph.capture_end()
        self.pieces.append((self._graph, collective))
        self._begin()


class _Branch:
    """Replays `middle` when `decide()` (a host read) says some row runs the middle blocks, else `reuse`."""

    def __init__(self, decide: Callable[[], bool], middle: Any, reuse: Any) -> None:
        self.decide, self.middle, self.reuse = decide, middle, reuse

    def replay(self) -> None:
        (self.middle if self.decide() else self.reuse).replay()


class _Captured:
    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        inputs: tuple[torch.Tensor | None, ...],
        cut_collectives: bool = True,
    ) -> None:
        self.static_inputs = tuple(None if t is None else t.clone() for t in inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), warming_up():
            step(*self.static_inputs)  # warm-up: compiles kernels, fills caches outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # NCCL's watchdog thread queries its events while this thread captures: only this thread's
        # unsafe calls may invalidate the capture
        mode = "thread_local" if dist.is_initialized() else "global"
        self.segments = GraphSegments(torch.cuda.CUDAGraph, torch.cuda.graph_pool_handle(), mode)
        with torch.cuda.stream(stream):
            self.static_output = self.segments.capture(lambda: step(*self.static_inputs), cut_collectives)

    def __call__(self, inputs: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        for static, value in zip(self.static_inputs, inputs, strict=True):
            if static is not None:
                static.copy_(value)
        self.segments.replay()
        return self.static_output.clone()


class GraphedStep:
    """Calls `step(*tensors, *static)` through captured CUDA graphs keyed by the tensors' shapes and dtypes
    and by the hashable `static` arguments (for the transformer: the latent grid).

    Each capture holds its own memory pool; the least recently used graphs beyond `max_graphs` are
    dropped (each new prompt length or image size is a new key), so a long-running server does not
    accumulate them. `cut_collectives` chooses segments between collectives or collectives inside.
    """

    def __init__(
        self, step: Callable[..., torch.Tensor], max_graphs: int = MAX_GRAPHS, cut_collectives: bool = True
    ) -> None:
        self.step = step
        self.max_graphs = max_graphs
        self.cut_collectives = cut_collectives
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()

    def __call__(
        self, *inputs: torch.Tensor | None, static: tuple = (), cache: BranchCache | None = None
    ) -> torch.Tensor:
        """The step's output; with a step `cache` (one CFG branch's), its own graphs hold its buffers."""
        key = (static, cache, *(None if t is None else (t.shape, t.dtype, t.device) for t in inputs))
        if key in self.graphs:
            self.graphs.move_to_end(key)
        else:
            while len(self.graphs) >= self.max_graphs:
                dropped, _ = self.graphs.popitem(last=False)
                if dropped[1] is not None:  # its step cache: the buffers the graph made go with it
                    dropped[1].forget(dropped)
            self.graphs[key] = _Captured(self._with(cache, static, key), inputs, self.cut_collectives)
        return self.graphs[key](inputs)

    def _with(self, cache: BranchCache | None, static: tuple, key: tuple) -> Callable[..., torch.Tensor]:
        def step(*tensors: torch.Tensor | None) -> torch.Tensor:
            with caching(cache), owned_by(key):
                return self.step(*tensors, *static)

        return step
