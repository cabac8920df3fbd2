"""NVFP4, ModelOpt's 4-bit format (DESIGN §19), and its weight path: torch twins and the Triton GEMM.

Format: E2M1 codes (sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two a byte along K, element 2i in
the low nibble and 2i + 1 in the high one (ModelOpt's `NVFP4QTensor`); one E4M3 scale per 16 values along
K; one fp32 global scale. A value is `e2m1 * e4m3 * global`.

Scales come from device tensors without a host read: the global encode scale is `e4m3_max * 6 / amax`
(Python numerator, IEEE division), capped at float32's largest value, with 1 where it is 0.

The weight path (`nvfp4_linear`): `y = bf16((x @ W.T) * weight_scale_2 + bias)` for BF16 activations x, where
`W = e2m1 * e4m3` is dequantized block by block (each product exact in BF16: 2 and 4 significant bits), the
dot products accumulate in fp32 and the global scale and bias come in the epilogue. For a few rows one Triton
GEMM decodes each weight tile where it uses it; for token rows the weight is decoded once into a BF16 scratch
and cuBLAS's BF16 GEMM sums into fp32 before the same epilogue. The torch twin sums in a float32 matmul: the
same exact products, summed in each one's order, so the two agree byte for byte wherever the fp32 sums are
exact (any order gives them) and otherwise within the rounding of those sums.
"""

import torch

from qwen_image_fusion.kernels._triton_common import (
    FP8_DTYPE,
    NO_FMA,
    FusedOp,
    interpreted,
    jit,
    launchable,
    tl,
    triton,
)
from qwen_image_fusion.kernels.fp32 import div_rn
from qwen_image_fusion.kernels.quant import FP8_MAX

E2M1_MAX = 6.0
NVFP4_BLOCK = 16  # values along K sharing one E4M3 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; code | 8 is negative
# E2M1 rounding: |v| above the bound of an even code moves up (ties stay), at or above that of an odd one
_UP_PAST = (0.25, 1.25, 2.5, 5.0)  # ties of 0|0.5, 1|1.5, 2|3, 4|6 go down to the even code
_UP_FROM = (0.75, 1.75, 3.5)  # ties of 0.5|1, 1.5|2, 3|4 go up to the even code
FP32_MAX = torch.finfo(torch.float32).max


def global_encode_scale(amax: torch.Tensor, e4m3_max: float = FP8_MAX) -> torch.Tensor:
    """fp32 `e4m3_max * 6 / amax`: the factor that maps a tensor's largest |value| to the largest block scale
    times the largest E2M1 value. No host read: the numerator is a Python number made a tensor of `amax`'s
    shape on its device (exact in fp32 for 448 * 6 and 256 * 6), the division IEEE; an amax of 0 (or one
    tiny enough to overflow) gives float32's largest value, an infinite one 1; NaN stays NaN."""
    numerator = torch.full_like(amax, e4m3_max * E2M1_MAX, dtype=torch.float32)
    scale = (numerator / amax.float()).clamp_max(FP32_MAX)
    return torch.where(scale == 0, 1.0, scale)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of fp32 `v`: nearest, ties to even, saturating at ±6; the sign bit is `v < 0` (so a
    negative value that rounds to 0 is -0); NaN gives 0. ModelOpt's `_cast_fp4` computes the same codes."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for bound in _UP_PAST:
        code += (mag > bound).to(torch.uint8)
    for bound in _UP_FROM:
        code += (mag >= bound).to(torch.uint8)
    return code | ((v < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """BF16 values of uint8 E2M1 codes (0..15), built from their bits as the kernel builds them: exponent
    126 + (m >> 1) with mantissa bit m & 1 for magnitudes m >= 2, 0.5 for m = 1, 0 for m = 0, then the sign
    (no table: nothing is copied from the host)."""
    c = codes.to(torch.int32)
    mag = c & 7
    normal = (((mag >> 1) + 126) << 7) | ((mag & 1) << 6)
    bits = torch.where(mag >= 2, normal, torch.where(mag == 1, 126 << 7, 0)) | ((c >> 3) << 15)
    return bits.to(torch.uint16).view(torch.bfloat16)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes as [..., K/2] bytes: element 2i in the low nibble, 2i + 1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes as [..., K] codes (the inverse of `pack_e2m1`)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize_nvfp4(values: torch.Tensor, encode_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed E2M1 codes [..., K/2] and E4M3 block scales [..., K/16] of `values` [..., K] under the global
    encode scale `encode_scale` (fp32, one element), on their device, without a host read. Per block of 16:
    `s = e4m3(min(amax / 6 * g, 448))` (IEEE ops, nearest even), then each value `e2m1(v * (g / s))` (a
    block whose scale rounds to 0 is all zeros). Decoding gives `e2m1 * s / g`."""
    v = values.float().unflatten(-1, (-1, NVFP4_BLOCK))
    g = encode_scale.float().reshape(())
    amax = v.abs().amax(dim=-1, keepdim=True)
    block_scale = (div_rn(amax, E2M1_MAX) * g).clamp(max=FP8_MAX).to(FP8_DTYPE)
    wide = block_scale.float()
    positive = wide > 0  # a block whose scale is 0 (or NaN) gets zero codes, with no division by 0
    factor = torch.where(positive, div_rn(g.expand_as(wide), torch.where(positive, wide, 1.0)), 0.0)
    codes = e2m1_encode(v * factor).flatten(-2)
    return pack_e2m1(codes), block_scale.squeeze(-1)


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """BF16 [N, K] `e2m1 * e4m3` of packed codes [N, K/2] and E4M3 block scales [N, K/16]: exact (a 2-bit
    and a 4-bit significand, between 2^-10 and 6 * 448). The codes are looked up in the 16 values
    `e2m1_decode` gives on the weights' device (a gather: 40x faster on the CPU than decoding every code)."""
    table = e2m1_decode(torch.arange(16, dtype=torch.uint8, device=packed.device)).float()
    values = table[unpack_e2m1(packed).long()].unflatten(-1, (-1, NVFP4_BLOCK))
    return (values * block_scale.float().unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def nvfp4_linear_fp32(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 `(x @ W.T) * weight_scale_2 + bias` before the one rounding to x's dtype, for x [M, K]."""
    acc = x.float() @ dequantize_nvfp4(packed, block_scale).float().t()
    out = acc * weight_scale_2.float().reshape(())
    return out if bias is None else out + bias.float()


def nvfp4_linear_torch(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The weight path's twin: x [M, K] times the NVFP4 weight, the global scale and bias, rounded once."""
    return nvfp4_linear_fp32(x, packed, block_scale, weight_scale_2, bias).to(x.dtype)


@jit()
def e2m1_to_bf16(codes):
    """BF16 values of E2M1 codes (int32 0..15) from their bits, as `e2m1_decode`."""
    mag = codes & 7
    normal = ((mag >> 1) + 126) << 7 | (mag & 1) << 6
    bits = tl.where(mag >= 2, normal, tl.where(mag == 1, 126 << 7, 0)) | (codes >> 3) << 15
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@jit()
def decode_tile(w_ptr, s_ptr, offs_n, cols, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BF16 `e2m1 * e4m3` of weight rows `offs_n`, columns k0 .. k0 + BLOCK_K (a multiple of 16): exact."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(
        w_ptr + offs_n[:, None] * (K // 2) + offs_b[None, :],
        mask=cols[:, None] & (offs_b < K // 2)[None, :],
        other=0,
    ).to(tl.int32)
    codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]: element 2i low, 2i + 1 high
    offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)  # one E4M3 scale per 16 codes, broadcast to them
    scale = tl.load(
        s_ptr + offs_n[:, None] * (K // 16) + offs_s[None, :],
        mask=cols[:, None] & (offs_s < K // 16)[None, :],
        other=0.0,
    ).to(tl.float32)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 16, 16)), (BLOCK_N, BLOCK_K))
    return (e2m1_to_bf16(codes).to(tl.float32) * scale).to(tl.bfloat16)


@jit()
def _nvfp4_linear_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, b_ptr, y_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    # one program per [BLOCK_M, BLOCK_N] output tile; K in steps of BLOCK_K (a multiple of 16)
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, cols = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        inside = rows[:, None] & (offs_k < K)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=inside, other=0.0)
        w = decode_tile(w_ptr, s_ptr, offs_n, cols, k0, K, BLOCK_N, BLOCK_K)
        if DOT_FP32:  # the interpreter's dot reads bf16 operands as raw bits: give it the same values in fp32
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    scale_bias_store(acc, s2_ptr, b_ptr, y_ptr, offs_m, offs_n, rows, cols, N, HAS_BIAS)


@jit()
def scale_bias_store(acc, s2_ptr, b_ptr, y_ptr, offs_m, offs_n, rows, cols, N, HAS_BIAS: tl.constexpr):
    """The epilogue: bf16 of `acc * global scale (+ bias)`, two fp32 roundings as the twin's."""
    out = acc * tl.load(s2_ptr)
    if HAS_BIAS:
        out = out + tl.load(b_ptr + offs_n, mask=cols, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * N + offs_n[None, :], out.to(tl.bfloat16), mask=rows[:, None] & cols[None, :]
    )


@jit()
def _nvfp4_decode_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per [BLOCK_N, BLOCK_K] tile of the BF16 weight
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    cols = offs_n < N
    w = decode_tile(w_ptr, s_ptr, offs_n, cols, k0, K, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w, mask=cols[:, None] & (offs_k < K)[None, :])


@jit()
def _nvfp4_epilogue_kernel(
    acc_ptr, s2_ptr, b_ptr, y_ptr, M, N,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # one program per [BLOCK_M, BLOCK_N] tile of the fp32 sums
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, cols = offs_m < M, offs_n < N
    inside = rows[:, None] & cols[None, :]
    acc = tl.load(acc_ptr + offs_m[:, None] * N + offs_n[None, :], mask=inside, other=0.0)
    scale_bias_store(acc, s2_ptr, b_ptr, y_ptr, offs_m, offs_n, rows, cols, N, HAS_BIAS)


def _nvfp4_linear_ok(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: torch.Tensor | None,
) -> bool:
    """Guard: a contiguous bf16 x [M, K] with K % 16 == 0, packed uint8 [N, K/2], E4M3 scales [N, K/16]
    (both contiguous), a one-element fp32 global scale, a bf16 bias [N] or none, all on one device."""
    tensors = [x, packed, block_scale, weight_scale_2, *([] if bias is None else [bias])]
    if not launchable(_nvfp4_linear_kernel, *tensors) or x.dim() != 2 or x.shape[0] == 0:
        return False
    k, n = x.shape[1], packed.shape[0]
    return (
        x.dtype == torch.bfloat16
        and x.is_contiguous()
        and k % NVFP4_BLOCK == 0
        and packed.dtype == torch.uint8
        and packed.shape == (n, k // 2)
        and packed.is_contiguous()
        and block_scale.dtype == FP8_DTYPE
        and block_scale.shape == (n, k // NVFP4_BLOCK)
        and block_scale.is_contiguous()
        and weight_scale_2.dtype == torch.float32
        and weight_scale_2.numel() == 1
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.shape == (n,)))
    )


FEW_ROWS = 16  # up to this many rows (the modulation linears) one GEMM decodes the weight per output tile
GEMV_TILES = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4}
DECODE_TILES = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4}
EPILOGUE_TILES = {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4}


MM_TO_FP32 = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(..., out_dtype=) of bf16 operands (torch >= 2.8)


def _fp32_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 `x @ weight.T` of bf16 operands: cuBLAS's BF16 GEMM with fp32 output on CUDA (the products exact,
    the sums in fp32); else an fp32 matmul of the same values (the twin's, on the interpreter's CPU tensors;
    on CUDA with a torch before `out_dtype`, where TF32, if enabled, still holds a bf16 value exactly)."""
    if x.is_cuda and MM_TO_FP32:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return x.float() @ weight.float().t()


def _launch_nvfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """A few rows: one GEMM decoding each weight tile where it is used. Token rows: the weight decoded once
    into a BF16 scratch (exact), cuBLAS's BF16 GEMM into fp32 sums, then the same epilogue: decoding per
    output tile made the GEMM decode every weight tile once per row tile, 3.4x a BF16 step (BENCHMARKS.md)."""
    rows, k = x.shape
    n = packed.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    bias_or_any = weight_scale_2 if bias is None else bias
    if rows <= FEW_ROWS:
        grid = (triton.cdiv(rows, GEMV_TILES["BLOCK_M"]), triton.cdiv(n, GEMV_TILES["BLOCK_N"]))
        _nvfp4_linear_kernel[grid](
            x, packed, block_scale, weight_scale_2, bias_or_any, y, rows, n, k,
            HAS_BIAS=bias is not None, DOT_FP32=interpreted(_nvfp4_linear_kernel), **GEMV_TILES, **NO_FMA,
        )  # fmt: skip
        return y
    weight = torch.empty(n, k, dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(n, DECODE_TILES["BLOCK_N"]), triton.cdiv(k, DECODE_TILES["BLOCK_K"]))
    _nvfp4_decode_kernel[grid](packed, block_scale, weight, n, k, **DECODE_TILES, **NO_FMA)
    sums = _fp32_sums(x, weight)
    grid = (triton.cdiv(rows, EPILOGUE_TILES["BLOCK_M"]), triton.cdiv(n, EPILOGUE_TILES["BLOCK_N"]))
    _nvfp4_epilogue_kernel[grid](
        sums, weight_scale_2, bias_or_any, y, rows, n, HAS_BIAS=bias is not None, **EPILOGUE_TILES, **NO_FMA
    )
    return y


# The NVFP4 weight path: Triton (and cuBLAS) on CUDA when the guard accepts, else the twin (always on CPU).
nvfp4_linear = FusedOp(nvfp4_linear_torch, _launch_nvfp4_linear, _nvfp4_linear_ok)
nvfp4_linear_triton = nvfp4_linear.triton
