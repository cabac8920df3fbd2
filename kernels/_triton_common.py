"""Shared plumbing of the Triton kernels: the op object that picks a kernel or its twin, optional import,
device checks, the row producers' guard and launch layout, dummy pointers, launch options.

Triton is a Linux-only dependency (pyproject), so without it the modules still import: `jit` is then a
no-op, `tl` a stand-in that only lets the kernel signatures evaluate, and every guard rejects, which sends
each op to its torch twin.
"""

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:
    triton = None
    tl = types.SimpleNamespace(constexpr=None)
    libdevice = None
    InterpretedFunction = ()

# Every kernel rounds each fp32 op on its own (DESIGN §4): never contract a*b+c into an FMA.
NO_FMA = {"enable_fp_fusion": False}
MAX_WIDTH = 16384  # widest row a row producer takes (one program holds a row)
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class FusedOp:
    """One fused op: its torch twin (the contract, on every device), its Triton launch and the guard that
    picks the launch. Called, it runs the launch when its first argument is a CUDA tensor the guard accepts,
    else the twin (always on a CPU). `triton(...)` runs the launch alone, None where the guard rejects the
    input: what the tests compare with the twin, and what runs on CPU tensors under the interpreter. The
    twin, the launch and the guard take the same arguments."""

    twin: Callable[..., Any]
    launch: Callable[..., Any]
    guard: Callable[..., bool]

    def triton(self, *args: Any, **kwargs: Any) -> Any:
        return self.launch(*args, **kwargs) if self.guard(*args, **kwargs) else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.triton(*args, **kwargs) if args[0].is_cuda else None
        return self.twin(*args, **kwargs) if out is None else out


def jit(**kwargs):
    """`triton.jit(**kwargs)`, or a no-op decorator when Triton is not installed."""
    if triton is None:
        return lambda fn: fn
    return triton.jit(**kwargs)


def interpreted(kernel) -> bool:
    """True when `kernel` runs under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(kernel, InterpretedFunction)


def launchable(kernel, *tensors: torch.Tensor) -> bool:
    """Triton is present and all tensors sit on one device that `kernel` runs on.

    Compiled kernels need CUDA tensors; the interpreter (tests only) needs CPU tensors.
    """
    if triton is None:
        return False
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        return False
    return device.type == ("cpu" if interpreted(kernel) else "cuda")


@functools.lru_cache
def fp8_capable(device: torch.device) -> bool:
    """E4M3 conversion needs compute capability 8.9+ (Ada, Hopper, Blackwell); the interpreter has it."""
    return device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)


def inverse_scale_ok(inv_scale: torch.Tensor, device: torch.device) -> bool:
    """A one-element fp32 inverse scale on `device`, on a device that can write E4M3."""
    return (
        inv_scale.dtype == torch.float32
        and inv_scale.numel() == 1
        and inv_scale.device == device
        and fp8_capable(device)
    )


@functools.lru_cache
def dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A real, 16-byte aligned tensor to pass for an output the launch does not write.

    Same dtype and alignment as a real output, so Triton's specialization (and the binary) is unchanged.
    """
    return torch.empty(16, dtype=dtype, device=device)


def row_producer_ok(
    kernel,
    acts: list[torch.Tensor],
    rows: list[tuple[torch.Tensor, torch.dtype]],
    index: torch.Tensor | None,
    inv_scale: torch.Tensor | None,
) -> bool:
    """The row producers' guard (LayerNorm + modulate, gated residuals): bf16 contiguous [B, L, D]
    activations, D % 16 == 0 and D <= MAX_WIDTH; modulation rows (tensor, dtype) [R, D] of their dtype with
    unit column stride and one R: the samples' (R = B) without an `index`, else R >= 1 with a contiguous
    int32 [B, L] `index` (its values in [0, R) are the caller's promise: checking them would sync with the
    host); an inverse scale the device can use; all on one device `kernel` runs on."""
    x = acts[0]
    tensors = [*acts, *(r for r, _ in rows), *([] if index is None else [index])]
    if not launchable(kernel, *tensors) or x.dim() != 3 or x.numel() == 0:
        return False
    batch, seq, width = x.shape
    if width % 16 or width > MAX_WIDTH:
        return False
    if any(a.dtype != torch.bfloat16 or a.shape != x.shape or not a.is_contiguous() for a in acts):
        return False
    first = rows[0][0]
    count = batch if index is None else first.shape[0] if first.dim() == 2 else 0
    if count < 1 or any(
        r.dtype != dtype or r.shape != (count, width) or r.stride(1) != 1 for r, dtype in rows
    ):
        return False
    if index is not None and not (
        index.dtype == torch.int32 and index.shape == (batch, seq) and index.is_contiguous()
    ):
        return False
    return inv_scale is None or inverse_scale_ok(inv_scale, x.device)


def row_launch(x: torch.Tensor) -> tuple[tuple[int], dict]:
    """A row producer's grid (one program per row) and options: BLOCK = next power of two >= D, no FMA, and
    32 elements a thread (4 warps at D = 3072: ~10% faster on H200 than 8 warps, 25% than 16)."""
    block = triton.next_power_of_2(x.shape[-1])
    return (x.shape[0] * x.shape[1],), {"BLOCK": block, "num_warps": max(4, min(16, block // 1024)), **NO_FMA}


def row_outputs(
    x: torch.Tensor, inv_scale: torch.Tensor | None, write_y: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row producer's y, q and the inverse scale to pass: real tensors where written, same-dtype dummies
    elsewhere."""
    device = x.device
    y = torch.empty_like(x) if write_y else dummy(device, torch.bfloat16)
    if inv_scale is None:
        return y, dummy(device, FP8_DTYPE), dummy(device, torch.float32)
    return y, torch.empty_like(x, dtype=FP8_DTYPE), inv_scale
