"""FP8 weight-only GEMV for a few rows: `y = bf16((x @ W.T) * s + b)` with E4M3 weights W [N, K] and one
fp32 scale per output channel s [N] (issue 24: the modulation linears `img_mod.1` / `txt_mod.1`, whose input
is one conditioning row per sample). The kernel reads each FP8 weight once, half the bytes of the BF16 layer
it replaces; rows beyond `MAX_ROWS` fall back to the torch twin.

Numerics: every product fp32(x) * fp32(w) is exact (8 and 4 significant bits); the kernel sums them in fp32
over blocks of K in its own order, the twin in a float32 matmul's: they agree to the fp32 rounding of the
sums, then scale, bias and one bf16 rounding. This is a lossy option measured for quality (BENCHMARKS.md),
not one of DESIGN §4's bit-exact contracts; one kernel serves the layer wherever its weight waits, so
streamed and resident runs give the same bytes.
"""

import torch

from qwen_image_fusion.kernels._triton_common import FP8_DTYPE, FusedOp, jit, launchable, tl, triton

MAX_ROWS = 16
_BLOCK_N = 32
_BLOCK_K = 128


def fp8_gemv_torch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) times the E4M3 weight [N, K] scaled per output channel, plus the bias."""
    out = (x.float() @ weight.float().t()) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@jit()
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program per BLOCK_N output channels, all M rows: the weight block is read once
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows, cols = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        inside = offs_k < K
        w_offs = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        w = tl.load(w_ptr + w_offs, mask=cols[:, None] & inside[None, :], other=0.0).to(tl.float32)
        x_offs = offs_m[:, None] * K + offs_k[None, :]
        x = tl.load(x_ptr + x_offs, mask=rows[:, None] & inside[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = acc * tl.load(s_ptr + offs_n, mask=cols, other=0.0)[None, :]
    if HAS_BIAS:
        out = out + tl.load(b_ptr + offs_n, mask=cols, other=0.0).to(tl.float32)[None, :]
    y_offs = offs_m[:, None] * N + offs_n[None, :]
    tl.store(y_ptr + y_offs, out.to(y_ptr.dtype.element_ty), mask=rows[:, None] & cols[None, :])


def _fp8_gemv_ok(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Guard: a contiguous bf16 x [M <= MAX_ROWS, K], a contiguous E4M3 weight and fp32 scales, one device."""
    tensors = (x, weight, scale) if bias is None else (x, weight, scale, bias)
    return (
        launchable(_fp8_gemv_kernel, *tensors)
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.is_contiguous()
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.dtype == FP8_DTYPE
        and weight.is_contiguous()
        and scale.dtype == torch.float32
    )


def _launch_fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, _BLOCK_N),)](
        x,
        weight,
        scale,
        scale if bias is None else bias,
        y,
        rows,
        n,
        k,
        HAS_BIAS=bias is not None,
        BLOCK_M=max(1, triton.next_power_of_2(rows)),
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        num_warps=4,
    )
    return y


# The weight-only FP8 GEMV: the Triton kernel on CUDA when it applies, else the torch twin (always on CPU).
fp8_gemv = FusedOp(fp8_gemv_torch, _launch_fp8_gemv, _fp8_gemv_ok)
fp8_gemv_triton = fp8_gemv.triton
