"""CUDA-graph replay of the transformer step: one capture per input signature, then replays.

The step has no host synchronisation (tests guard it), so the whole 60-block forward can be captured
once and replayed, removing thousands of kernel launches per step. Replays run the same kernels on
the same data as eager execution; the variant switch drops all captured graphs.
"""

from collections import OrderedDict
from collections.abc import Callable

import torch

from models.config import env_flag

GRAPHS_ENV = "QWEN_IMAGE_CUDA_GRAPHS"
MAX_GRAPHS = 4  # cond and negative branch of two prompt lengths


def cuda_graphs_enabled_by_env() -> bool:
    """`QWEN_IMAGE_CUDA_GRAPHS=0` turns capture off (eager steps)."""
    return env_flag(GRAPHS_ENV)


class _Captured:
    def __init__(self, step: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor | None, ...]) -> None:
        self.static_inputs = tuple(None if t is None else t.clone() for t in inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(*self.static_inputs)  # warm-up: compiles kernels, fills caches outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_output = step(*self.static_inputs)

    def __call__(self, inputs: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        for static, value in zip(self.static_inputs, inputs, strict=True):
            if static is not None:
                static.copy_(value)
        self.graph.replay()
        return self.static_output.clone()


class GraphedStep:
    """Calls `step(*tensors, *static)` through captured CUDA graphs keyed by the tensors' shapes and dtypes
    and by the hashable `static` arguments (for the transformer: the latent grid).

    Each capture holds its own memory pool; the least recently used graphs beyond `max_graphs` are
    dropped (each new prompt length or image size is a new key), so a long-running server does not
    accumulate them.
    """

    def __init__(self, step: Callable[..., torch.Tensor], max_graphs: int = MAX_GRAPHS) -> None:
        self.step = step
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()

    def __call__(self, *inputs: torch.Tensor | None, static: tuple = ()) -> torch.Tensor:
        key = (static, *(None if t is None else (t.shape, t.dtype, t.device) for t in inputs))
        if key in self.graphs:
            self.graphs.move_to_end(key)
        else:
            while len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            self.graphs[key] = _Captured(lambda *tensors: self.step(*tensors, *static), inputs)
        return self.graphs[key](inputs)
