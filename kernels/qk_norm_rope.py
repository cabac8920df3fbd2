"""Per-head RMSNorm of q/k followed by interleaved-pair RoPE: torch twin and Triton, one launch per tensor.

Contract (the q/k path of the `contract` numerics), per row `x` = one head of one token, D = head_dim:
  fp32 math; `var = sum(fp32(x)^2) / D`; `rstd = 1 / sqrt(var + eps)` with IEEE sqrt and division
  (never the approximate rsqrt); the twin sums in kernels/fp32.py's pinned order, so its bytes are
  the same on every machine;
  `n = bf16(fp32(x) * rstd)`; `w = bf16(fp32(n) * fp32(weight))`  (diffusers' RMSNorm rounding: x times
  rsqrt in fp32, cast to bf16, times the bf16 weight);
  rope on the interleaved pairs `(a, b) = (w[2i], w[2i+1])` with `(cos, sin) = rope[s, i]`:
  `out[2i] = bf16(a*cos - b*sin)`, `out[2i+1] = bf16(a*sin + b*cos)`, each fp32 op rounded on its own
  (no FMA contraction; the kernel launches with fp fusion off).
Only the order of the sum of squares may differ between the Triton kernel and the twin.

`x` is [B, S, H, D] bf16 with unit stride on D (any other strides: e.g. the `unflatten` view of a
[B, S, H*D] projection output); `rope` is [S, D/2, 2] fp32 (cos, sin), i.e. `torch.view_as_real` of the
model's complex64 rotations. `out` (optional) is a [B, S, H, D] bf16 view with unit stride on D, e.g.
the text or image rows of a joint [B, S_txt + S_img, H, D] buffer, so no `torch.cat` is needed.

Versus diffusers (`RMSNorm` with torch's mean and `torch.rsqrt`, then `apply_rotary_emb_qwen(use_real=
False)`, a complex64 multiply) the twin differs only where the two rstd differ in the last fp32 bit (n
moves by one bf16 step) and where the complex multiply rounds `a*cos - b*sin` otherwise (an FMA or
another grouping): tests/test_qk_norm_rope.py states the tolerance.
"""

import torch

from qwen_image_fusion.kernels._triton_common import NO_FMA, FusedOp, jit, launchable, tl, triton
from qwen_image_fusion.kernels.fp32 import div_rn, row_sum, sqrt_rn

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 512
MAX_TOKEN_ELEMENTS = 16384  # heads (rounded up to a power of two) x head_dim held by one program


def _warps(elements: int) -> int:
    """About 16 elements a thread: 8 warps for a 32 x 128 token block."""
    return max(1, min(16, elements // 512))


def rms_norm_rope_torch(
    x: torch.Tensor, weight: torch.Tensor, rope: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm + RoPE following the contract above; writes into `out` when given and returns it."""
    xf = x.float()
    var = div_rn(row_sum(xf * xf), x.shape[-1])
    rstd = div_rn(torch.ones_like(var), sqrt_rn(var + eps))
    n = (xf * rstd).to(torch.bfloat16)
    w = (n.float() * weight.float()).to(torch.bfloat16).float()
    a, b = w[..., 0::2], w[..., 1::2]
    cos, sin = rope[..., 0].unsqueeze(1), rope[..., 1].unsqueeze(1)  # [S, 1, D/2]: broadcast over heads
    y = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(torch.bfloat16)
    return y if out is None else out.copy_(y)


@jit()
def _rms_norm_rope_kernel(
    x_ptr, w_ptr, rope_ptr, out_ptr,
    seq_len, heads,
    x_stride_b, x_stride_s, x_stride_h, rope_stride_s, out_stride_b, out_stride_s, out_stride_h,
    eps,
    D: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    # One program per token: all its heads share one rope row and the weight, loaded once.
    token = tl.program_id(0).to(tl.int64)
    s = token % seq_len
    b = token // seq_len
    head = tl.arange(0, HEADS)
    cols = tl.arange(0, D)
    mask = (head < heads)[:, None]
    x_offs = (b * x_stride_b + s * x_stride_s + head * x_stride_h)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.math.div_rn(tl.sum(x * x, axis=1), tl.full((HEADS,), D, tl.float32))
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    n = (x * rstd[:, None]).to(tl.bfloat16)
    weight = tl.load(w_ptr + cols).to(tl.float32)
    w = (n.to(tl.float32) * weight[None, :]).to(tl.bfloat16).to(tl.float32)
    # interleaved pairs: [HEADS, D] -> [HEADS, D/2, 2] -> (even, odd); the rope row is (cos, sin) pairs alike
    a, b_odd = tl.split(tl.reshape(w, (HEADS, D // 2, 2)))
    rope = tl.load(rope_ptr + s * rope_stride_s + cols)
    cos, sin = tl.split(tl.reshape(rope, (D // 2, 2)))
    real = (a * cos[None, :] - b_odd * sin[None, :]).to(tl.bfloat16)
    imag = (a * sin[None, :] + b_odd * cos[None, :]).to(tl.bfloat16)
    y = tl.reshape(tl.join(real, imag), (HEADS, D))
    out_offs = (b * out_stride_b + s * out_stride_s + head * out_stride_h)[:, None] + cols[None, :]
    tl.store(out_ptr + out_offs, y, mask=mask)


def _head_dim_ok(dim: int) -> bool:
    return MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM and dim & (dim - 1) == 0


def _rms_norm_rope_ok(
    x: torch.Tensor, weight: torch.Tensor, rope: torch.Tensor, out: torch.Tensor | None
) -> bool:
    """Guard: bf16 x [B, S, H, D] with D a power of two in [16, 512], next_pow2(H) * D <= 16384 and unit
    stride on D; bf16 weight [D]
    with unit stride; fp32 rope [S, D/2, 2] whose rows are D contiguous floats (cos, sin, cos, ...); an
    optional bf16 `out` of x's shape with unit stride on D; all on one device the kernel runs on."""
    tensors = (x, weight, rope) if out is None else (x, weight, rope, out)
    if not launchable(_rms_norm_rope_kernel, *tensors) or x.dim() != 4 or x.numel() == 0:
        return False
    _, seq, heads, dim = x.shape
    if not _head_dim_ok(dim) or x.dtype != torch.bfloat16 or x.stride(3) != 1:
        return False
    if triton.next_power_of_2(heads) * dim > MAX_TOKEN_ELEMENTS:
        return False
    if weight.dtype != torch.bfloat16 or weight.shape != (dim,) or weight.stride(0) != 1:
        return False
    if rope.dtype != torch.float32 or rope.shape != (seq, dim // 2, 2) or rope.stride()[1:] != (2, 1):
        return False
    return out is None or (out.dtype == torch.bfloat16 and out.shape == x.shape and out.stride(3) == 1)


def _launch_rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, rope: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel on guarded inputs (one launch; writes `out` when given)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    batch, seq, heads, dim = x.shape
    heads_block = triton.next_power_of_2(heads)
    _rms_norm_rope_kernel[(batch * seq,)](
        x, weight, rope, out, seq, heads,
        x.stride(0), x.stride(1), x.stride(2), rope.stride(0), out.stride(0), out.stride(1), out.stride(2),
        eps, D=dim, HEADS=heads_block, num_warps=_warps(heads_block * dim), **NO_FMA,
    )  # fmt: skip
    return out


def _rms_norm_rope_guard(
    x: torch.Tensor, weight: torch.Tensor, rope: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> bool:
    return _rms_norm_rope_ok(x, weight, rope, out)


# RMSNorm + RoPE of q or k: Triton on CUDA when the guard accepts, else the torch twin (always on CPU).
rms_norm_rope = FusedOp(rms_norm_rope_torch, _launch_rms_norm_rope, _rms_norm_rope_guard)
rms_norm_rope_triton = rms_norm_rope.triton
