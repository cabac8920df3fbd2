"""Static per-tensor FP8 (E4M3) quantizer: torch twin and Triton kernel of DESIGN §4.

`q = e4m3fn(clamp(fp32(y) * inv_s, -448, 448))` with `inv_s = fp32(1 / input_scale)` computed once,
with IEEE division, when the scales are loaded. Nothing divides by the scale per call. The Triton
kernel loads `inv_s` through a pointer (no host sync), clamps with NaN propagation and converts with
round-to-nearest-even (`cvt.rn.satfinite` on sm_89+).
"""

import torch

from qwen_image_fusion.kernels._triton_common import (
    FP8_DTYPE,
    NO_FMA,
    FusedOp,
    inverse_scale_ok,
    jit,
    launchable,
    tl,
    triton,
)

FP8_MAX = 448.0
_QUANT_BLOCK = 4096
_MAX_SAMPLES = 65535  # CUDA's limit on the second grid dimension


MAX_EXACT_K = 1 << 17


def exact_fp8_dot(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 `q @ W.T` of E4M3 q [M, K] and W [N, K], each dot product exact and then rounded once.

    E4M3 values are multiples of 2^-9 below 2^9, so each product is a multiple of 2^-18 below 2^18 and a
    sum of K <= 2^17 of them a multiple of 2^-18 below 2^53 of those units: every partial sum is a
    float64 number, so float64 matrix products are exact in any order, blocking or thread count.
    """
    if q.shape[-1] > MAX_EXACT_K:
        raise ValueError(f"FP8 GEMM emulation: K = {q.shape[-1]} is above {MAX_EXACT_K}, the exact limit")
    return (q.double() @ weight.double().t()).float()


def inverse_scale(input_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [1] tensor `1 / input_scale`, by IEEE division, on the scale's device."""
    scale = input_scale.detach().to(torch.float32).reshape(1)
    return torch.ones_like(scale) / scale


def static_quant_fp8_torch(y: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """Quantize `y` to E4M3 with a precomputed inverse scale (round to nearest even, NaN kept)."""
    return (y.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@jit()
def quant_fp8(y, inv_scale_ptr):
    """Device helper shared by every FP8 writer: E4M3 of the bf16 block `y` (the contract above)."""
    v = y.to(tl.float32) * tl.load(inv_scale_ptr)
    v = tl.clamp(v, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return v.to(tl.float8e4nv)


@jit()
def _static_quant_fp8_kernel(y_ptr, q_ptr, inv_scale_ptr, sample_numel, sample_stride, BLOCK: tl.constexpr):
    # grid (blocks of one sample, samples): each sample of y is contiguous, samples `sample_stride` apart
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    sample = tl.program_id(1).to(tl.int64)
    mask = offs < sample_numel
    y = tl.load(y_ptr + sample * sample_stride + offs, mask=mask, other=0.0)
    tl.store(q_ptr + sample * sample_numel + offs, quant_fp8(y, inv_scale_ptr), mask=mask)


def _static_quant_ok(y: torch.Tensor, inv_scale: torch.Tensor) -> bool:
    """Guard: bf16 `y` whose samples `y[i]` are each contiguous (no copy of a row slice first), not empty,
    with an inverse scale the device can use."""
    return (
        launchable(_static_quant_fp8_kernel, y)
        and y.dtype == torch.bfloat16
        and y.numel() > 0
        and inverse_scale_ok(inv_scale, y.device)
        and (y.is_contiguous() or (y.dim() >= 2 and y.shape[0] <= _MAX_SAMPLES and y[0].is_contiguous()))
    )


def _launch_static_quant(y: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """The kernel on guarded `y`; the result is contiguous."""
    if y.is_contiguous():
        samples, sample_numel, sample_stride = 1, y.numel(), y.numel()
    else:
        samples, sample_numel, sample_stride = y.shape[0], y[0].numel(), y.stride(0)
    q = torch.empty(y.shape, dtype=FP8_DTYPE, device=y.device)
    grid = (triton.cdiv(sample_numel, _QUANT_BLOCK), samples)
    _static_quant_fp8_kernel[grid](
        y, q, inv_scale, sample_numel, sample_stride, BLOCK=_QUANT_BLOCK, num_warps=8, **NO_FMA
    )
    return q


static_quant_fp8 = FusedOp(static_quant_fp8_torch, _launch_static_quant, _static_quant_ok)
static_quant_fp8_triton = static_quant_fp8.triton
