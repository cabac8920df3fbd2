"""Shared plumbing of the Triton kernels: optional import, device checks, dummy pointers, launch options.

Triton is a Linux-only dependency (pyproject), so without it the modules still import: `jit` is then a
no-op, `tl` a stand-in that only lets the kernel signatures evaluate, and every `*_triton` function
returns None, which sends its dispatcher to the torch twin.
"""

import functools
import types

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
