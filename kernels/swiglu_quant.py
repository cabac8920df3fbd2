"""SwiGLU product of Qwen-Image 2.1's MLP and its static FP8 quantization: torch twin and Triton
(DESIGN §4.1).

Contract (the input of `img_mlp.out`), per element of the bf16 outputs `g = gate_layer(x)`, `p = proj(x)`:
  v = fp32(g); e = exp(-v) in fp32; s = v / (1 + e) (IEEE division; silu(-inf) = -inf / inf = NaN);
  y = bf16(s * fp32(p)), rounded once (s stays fp32); q = the static quantizer of DESIGN §4 applied to y.
  exp: the twin rounds a float64 `torch.exp` to fp32 once (the same bits as numpy's float64 exp rounded to
  fp32 on every bf16 input, in every layout and thread count, which torch's fp32 exp is not); the kernel calls
  libdevice `expf` (non-FTZ, within 2 ulp); under the CPU interpreter, which cannot call libdevice, `tl.exp`.
The twin and the kernel may differ where the two exps differ in the last bits (s by an ulp, y then rarely by
one bf16 step); the kernel's fused (write q) and unfused (write y, then quantize) paths are one binary and
agree exactly.
"""

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

_BLOCK = 2048  # 8 warps: 8 elements a thread, as the GELU kernel


def silu_torch(g: torch.Tensor) -> torch.Tensor:
    """fp32 `v / (1 + exp(-v))` of bf16 `g`, exp rounded once from float64."""
    v = g.float()
    return v / (1.0 + torch.exp((-v).double()).float())


def silu_mul_torch(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`bf16(silu(g) * fp32(p))` following the contract above."""
    return (silu_torch(g) * p.float()).to(torch.bfloat16)


def silu_mul_quant_torch(g: torch.Tensor, p: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 quantization of `silu_mul_torch(g, p)` with the precomputed inverse scale."""
    return static_quant_fp8_torch(silu_mul_torch(g, p), inv_scale)


@jit()
def _exp(v, INTERPRET: tl.constexpr):
    return tl.exp(v) if INTERPRET else libdevice.exp(v)


@jit(do_not_specialize=["write_y", "write_q"])
def _silu_mul_quant_kernel(
    g_ptr, p_ptr, y_ptr, q_ptr, inv_ptr, numel, write_y, write_q, BLOCK: tl.constexpr, INTERPRET: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.math.div_rn(v, 1.0 + _exp(-v, INTERPRET))
    y = (s * p).to(tl.bfloat16)
    if write_y != 0:
        tl.store(y_ptr + offs, y, mask=mask)
    if write_q != 0:
        tl.store(q_ptr + offs, quant_fp8(y, inv_ptr), mask=mask)


def _silu_mul_ok(g: torch.Tensor, p: torch.Tensor) -> bool:
    """Guard: bf16 contiguous g and p of one shape, not empty, on a device the kernel runs on."""
    return (
        launchable(_silu_mul_quant_kernel, g, p)
        and g.dtype == p.dtype == torch.bfloat16
        and g.shape == p.shape
        and g.is_contiguous()
        and p.is_contiguous()
        and g.numel() > 0
    )


def _launch(g: torch.Tensor, p: torch.Tensor, inv_scale: torch.Tensor | None, write_y: bool):
    """Run the kernel on guarded inputs: `(y or a dummy, q or a dummy)`."""
    device = g.device
    y = torch.empty_like(g) if write_y else dummy(device, torch.bfloat16)
    q = dummy(device, FP8_DTYPE) if inv_scale is None else torch.empty_like(g, dtype=FP8_DTYPE)
    inv = dummy(device, torch.float32) if inv_scale is None else inv_scale
    kernel = _silu_mul_quant_kernel
    kernel[(triton.cdiv(g.numel(), _BLOCK),)](
        g, p, y, q, inv, g.numel(), int(write_y), int(inv_scale is not None), BLOCK=_BLOCK,
        INTERPRET=interpreted(kernel), num_warps=8, enable_reflect_ftz=False, **NO_FMA,
    )  # fmt: skip
    return y, q


def _silu_mul_quant_twin(
    g: torch.Tensor, p: torch.Tensor, inv_scale: torch.Tensor, write_y: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The torch twins of the fused op: `(y if write_y else None, q)`."""
    y = silu_mul_torch(g, p)
    return (y if write_y else None), static_quant_fp8_torch(y, inv_scale)


def _silu_mul_quant_ok(
    g: torch.Tensor, p: torch.Tensor, inv_scale: torch.Tensor, write_y: bool = False
) -> bool:
    return _silu_mul_ok(g, p) and inverse_scale_ok(inv_scale, g.device)


def _launch_silu_mul_quant(
    g: torch.Tensor, p: torch.Tensor, inv_scale: torch.Tensor, write_y: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Fused SwiGLU + FP8 quantization: `(y if write_y else None, q)`."""
    y, q = _launch(g, p, inv_scale, write_y)
    return (y if write_y else None), q


# The SwiGLU product, and SwiGLU + quantization fused: Triton on CUDA when the guard accepts, else the twins.
silu_mul = FusedOp(silu_mul_torch, lambda g, p: _launch(g, p, None, True)[0], _silu_mul_ok)
silu_mul_quant = FusedOp(_silu_mul_quant_twin, _launch_silu_mul_quant, _silu_mul_quant_ok)
silu_mul_triton = silu_mul.triton
silu_mul_quant_triton = silu_mul_quant.triton
