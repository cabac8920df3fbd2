"""GELU(tanh) of the MLP hidden state and its static FP8 quantization: torch twin and Triton.

Contract (the input of `mlp.net.2`), per element of the bf16 input `h`:
  x = fp32(h); inner = sqrt(2/pi) * (x + 0.044715 * ((x * x) * x)), each fp32 op rounded on its own
  (no FMA; the constants are the fp32 roundings of sqrt(2/pi) and 0.044715);
  t = tanh(inner) in fp32: correctly rounded in the twin (see `tanh_fp32`), libdevice `tanhf` (non-FTZ,
  at most 2 ulps off by CUDA's documentation) in the compiled kernel, an exp-based formula under the
  CPU interpreter, which cannot call libdevice;
  g = bf16((0.5 * x) * (1 + t)), rounded once; q = the static quantizer of DESIGN §4 applied to bf16 g.
The twin gives the same bytes on every machine; the kernel may differ from it where tanhf is not
correctly rounded. The kernel's fused (write q) and unfused (write g, then quantize) paths are one
binary and agree exactly.
"""

import functools

import torch

from qwen_image_fusion.kernels._triton_common import (
    NO_FMA,
    FusedOp,
    dummy,
    interpreted,
    inverse_scale_ok,
    jit,
    launchable,
    libdevice,
    tl,
    triton,
)
from qwen_image_fusion.kernels.quant import FP8_DTYPE, quant_fp8, static_quant_fp8_torch

SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715
_GELU_BLOCK = 2048  # with 8 warps: 8 elements a thread, ~2x faster on H200 than 16 (libdevice tanh)


def tanh_fp32(inner: torch.Tensor) -> torch.Tensor:
    """fp32 tanh of the fp32 `inner` of a bf16 input: torch's float64 tanh, rounded once.

    fp32 `torch.tanh` differs from machine to machine (vector math libraries). Rounding a float64 tanh
    is the correctly rounded fp32 tanh wherever the exact value is further from every fp32 rounding
    boundary than the float64 error: for the at most 65536 values `inner` takes on bf16 inputs it is
    at least 2^17 float64 ulps away (tests/test_machine_independent.py checks them all against an
    80-digit tanh), and float64 tanh libraries are good to a few ulps. So this gives the same bytes on
    every machine.
    """
    return torch.tanh(inner.double()).float()


def gelu_tanh_chain(h: torch.Tensor) -> torch.Tensor:
    """bf16 GELU(tanh) of bf16 `h`: the contract above, op for op."""
    x = h.float()
    inner = SQRT_2_OVER_PI * (x + GELU_CUBIC * (x * x * x))
    return (0.5 * x * (1.0 + tanh_fp32(inner))).to(torch.bfloat16)


@functools.cache
def _gelu_table() -> torch.Tensor:
    """`gelu_tanh_chain` of all 65536 bf16 encodings, entry `i` for the int16 encoding `i - 32768`."""
    codes = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    return gelu_tanh_chain(codes.view(torch.bfloat16))


def gelu_tanh_torch(h: torch.Tensor) -> torch.Tensor:
    """bf16 GELU(tanh) of bf16 `h` following the contract above. g depends on the bf16 h alone, so on CPU
    it is read from the chain's table of every encoding (the same bytes, ~4x faster than the float64 tanh
    there); elsewhere the chain runs (no host-built table inside a CUDA graph capture)."""
    if h.dtype != torch.bfloat16:
        raise TypeError(f"GELU twin: bf16 input expected, got {h.dtype}")
    if h.device.type != "cpu":
        return gelu_tanh_chain(h)
    return _gelu_table()[h.view(torch.int16).int() + (1 << 15)]


def gelu_tanh_quant_torch(h: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 quantization of `gelu_tanh_torch(h)` with the precomputed inverse scale."""
    return static_quant_fp8_torch(gelu_tanh_torch(h), inv_scale)


@jit()
def _tanh_via_exp(v):
    """tanh for the CPU interpreter (tests only), which cannot call libdevice; no overflow, NaN kept."""
    e = tl.exp(-2.0 * tl.abs(v))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(v < 0, -t, t)


@jit()
def _tanh(v, INTERPRET: tl.constexpr):
    return _tanh_via_exp(v) if INTERPRET else libdevice.tanh(v)


@jit()
def gelu_tanh_bf16(x, INTERPRET: tl.constexpr):
    """Device helper shared by every GELU writer (this kernel, the FP8 GEMM's epilogue): bf16 GELU(tanh) of
    the fp32 block `x` (the fp32 of bf16 values), the contract above. Launch with `NO_FMA` and
    `enable_reflect_ftz=False`, as `_launch_gelu` does, so that every caller compiles the same arithmetic."""
    inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))  # SQRT_2_OVER_PI, GELU_CUBIC
    return (0.5 * x * (1.0 + _tanh(inner, INTERPRET))).to(tl.bfloat16)


@jit(do_not_specialize=["write_g", "write_q"])
def _gelu_tanh_quant_kernel(
    h_ptr, g_ptr, q_ptr, inv_ptr, numel, write_g, write_q, BLOCK: tl.constexpr, INTERPRET: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = gelu_tanh_bf16(x, INTERPRET)
    if write_g != 0:
        tl.store(g_ptr + offs, g, mask=mask)
    if write_q != 0:
        tl.store(q_ptr + offs, quant_fp8(g, inv_ptr), mask=mask)


def _launch_gelu(
    h: torch.Tensor, g: torch.Tensor, q: torch.Tensor, inv: torch.Tensor, write_g: bool, write_q: bool
) -> None:
    kernel = _gelu_tanh_quant_kernel
    grid = (triton.cdiv(h.numel(), _GELU_BLOCK),)
    kernel[grid](
        h, g, q, inv, h.numel(), int(write_g), int(write_q), BLOCK=_GELU_BLOCK,
        INTERPRET=interpreted(kernel), num_warps=8, enable_reflect_ftz=False, **NO_FMA,
    )  # fmt: skip


def _gelu_ok(h: torch.Tensor) -> bool:
    return (
        launchable(_gelu_tanh_quant_kernel, h)
        and h.dtype == torch.bfloat16
        and h.is_contiguous()
        and h.numel() > 0
    )


def _launch_gelu_only(h: torch.Tensor) -> torch.Tensor:
    """The kernel with only g written."""
    g = torch.empty_like(h)
    _launch_gelu(h, g, dummy(h.device, FP8_DTYPE), dummy(h.device, torch.float32), True, False)
    return g


def _gelu_quant_twin(
    h: torch.Tensor, inv_scale: torch.Tensor, write_g: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The torch twins of the fused op: `(g if write_g else None, q)`."""
    g = gelu_tanh_torch(h)
    return (g if write_g else None), static_quant_fp8_torch(g, inv_scale)


def _gelu_quant_ok(h: torch.Tensor, inv_scale: torch.Tensor, write_g: bool = False) -> bool:
    return _gelu_ok(h) and inverse_scale_ok(inv_scale, h.device)


def _launch_gelu_quant(
    h: torch.Tensor, inv_scale: torch.Tensor, write_g: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Fused GELU + FP8 quantization: `(g if write_g else None, q)`."""
    g = torch.empty_like(h) if write_g else dummy(h.device, torch.bfloat16)
    q = torch.empty_like(h, dtype=FP8_DTYPE)
    _launch_gelu(h, g, q, inv_scale, write_g, True)
    return (g if write_g else None), q


# GELU(tanh), and GELU + quantization fused: Triton on CUDA when the guard accepts, else the torch twins.
gelu_tanh = FusedOp(gelu_tanh_torch, _launch_gelu_only, _gelu_ok)
gelu_tanh_quant = FusedOp(_gelu_quant_twin, _launch_gelu_quant, _gelu_quant_ok)
gelu_tanh_triton = gelu_tanh.triton
gelu_tanh_quant_triton = gelu_tanh_quant.triton
