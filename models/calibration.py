"""Forward hooks recording each linear's running max |input|: FP8 calibration, the input-clipping check."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def record_input_amax(linears: dict[str, nn.Module]) -> Iterator[dict[str, torch.Tensor]]:
    """While active, the running max |input| of each linear (device scalars, no host syncs).

    On exit the hooks are removed, and a linear that never ran is an error.
    """
    amax: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            current = args[0].detach().abs().amax().float()
            amax[name] = current if name not in amax else torch.maximum(amax[name], current)

        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    try:
        yield amax
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(set(linears) - set(amax))
    if missing:
        raise RuntimeError(f"calibration never reached {missing[:3]}")
