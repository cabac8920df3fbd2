"""NVFP4 activation quantizer for Blackwell's W4A4 GEMM (DESIGN §19): torch twin and Triton kernel.

`y` [M, K] (bf16) becomes packed E2M1 codes [M, K/2] (element 2i in the low nibble) and E4M3 block scales,
one per 16 values along K, under the global encode scale `g` (fp32 [1], `1 / input_scale`, computed once at
load), with the arithmetic of `quantize_nvfp4` (kernels/nvfp4.py): `s = e4m3(min(amax / 6 * g, 448))`, then
`e2m1(v * (g / s))`. The block scales are written in the layout `torch._scaled_mm` reads for NVFP4
(cuBLAS's 128x4 tiles, each 32x4x4 inside: `SwizzleType.SWIZZLE_32_4_4`), rows padded to 128 and scale
columns to 4 with zeros: a [ceil(M/128)*128, ceil(K/64)*4] tensor whose bytes are in that order.

The kernel computes every narrowing from the fp32 bits (E4M3 and E2M1 codes by integer and comparison ops,
no `cvt`), so it gives the twin's bytes on the GPU and under Triton's CPU interpreter alike (whose fp32 to
fp8 conversion is wrong: DESIGN §4); the block amax is an integer max of the |v| bits (NaN stays NaN, and no
float max that could drop it). The row producers (kernels/nvfp4_producers.py) call the same `store_nvfp4_row`.
"""

import torch

from qwen_image_fusion.kernels._triton_common import (
    FP8_DTYPE,
    NO_FMA,
    FusedOp,
    jit,
    launchable,
    tl,
    triton,
)
from qwen_image_fusion.kernels.nvfp4 import NVFP4_BLOCK, quantize_nvfp4

SCALE_TILE_ROWS, SCALE_TILE_COLS = 128, 4  # cuBLAS's block-scale tile (128 rows x 4 scales)
MAX_K = 16384  # widest row the kernel takes (one program holds a row)


def swizzled_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """[rows, scale_cols] padded to whole 128x4 tiles."""
    return -(-rows // SCALE_TILE_ROWS) * SCALE_TILE_ROWS, -(-scale_cols // SCALE_TILE_COLS) * SCALE_TILE_COLS


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [R, C] in `torch._scaled_mm`'s NVFP4 layout: [R', C'] (padded with zeros) whose flat bytes
    are tile by tile (row tiles of 128, column tiles of 4), each tile 32x4x4: scale (r, c) of a tile at
    (r % 32) * 16 + (r // 32) * 4 + c."""
    rows, cols = scales.shape
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    padded = torch.zeros(padded_rows, padded_cols, dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = scales.view(torch.uint8)
    tiles = padded.view(padded_rows // 128, 128, padded_cols // 4, 4).permute(0, 2, 1, 3)
    swizzled = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(padded_rows, padded_cols)
    return swizzled.view(scales.dtype)


def unswizzle_block_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] block scales of a `swizzle_block_scales` layout (the inverse, padding dropped)."""
    padded_rows, padded_cols = swizzled.shape
    tiles = swizzled.view(torch.uint8).reshape(-1, 32, 4, 4).transpose(1, 2)
    padded = tiles.reshape(padded_rows // 128, padded_cols // 4, 128, 4).permute(0, 2, 1, 3)
    return padded.reshape(padded_rows, padded_cols)[:rows, :cols].view(swizzled.dtype)


def nvfp4_quant_torch(y: torch.Tensor, encode_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: packed codes [M, K/2] and swizzled E4M3 block scales of y [..., K] (rows flattened)."""
    rows = y.reshape(-1, y.shape[-1])
    packed, block_scale = quantize_nvfp4(rows, encode_scale)
    return packed, swizzle_block_scales(block_scale)


@jit()
def e4m3_code(v):
    """E4M3FN codes (int32) of fp32 `v` in [0, 448] or NaN: nearest, ties to even, from the fp32 bits.
    Normal E4M3 (v >= 2^-6): the top 3 mantissa bits, rounded up past half or at half to even (a carry runs
    into the exponent); below, the nearest multiple of 2^-9, by an fp32 sum with 2^23; NaN: 0x7F."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    kept = ((exponent - 120) << 3) | ((bits >> 20) & 7)
    rest = bits & 0xFFFFF
    normal = kept + ((rest > 0x80000) | ((rest == 0x80000) & ((kept & 1) == 1))).to(tl.int32)
    subnormal = ((v * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(exponent >= 121, normal, subnormal)
    return tl.where(v != v, 0x7F, code)


@jit()
def e4m3_value(code):
    """fp32 value of E4M3FN codes (int32 0..0x7F; 0x7F is NaN), from the bits."""
    exponent = code >> 3
    mantissa = code & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    bits = tl.where(code == 0x7F, 0x7FC00000, normal)
    value = bits.to(tl.float32, bitcast=True)
    return tl.where(exponent > 0, value, mantissa.to(tl.float32) * 0.001953125)  # subnormal: m * 2^-9


@jit()
def e2m1_code(v):
    """E2M1 codes (int32) of fp32 `v`: nearest, ties to even, saturating at 6; sign bit `v < 0`; NaN: 0
    (kernels/nvfp4.py `e2m1_encode`)."""
    mag = tl.abs(v)
    code = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
    code += (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
    code += (mag > 5.0).to(tl.int32)
    return code | ((v < 0).to(tl.int32) << 3)


@jit()
def store_nvfp4_row(y, row, width, q_ptr, s_ptr, g_ptr, scale_tiles, BLOCK: tl.constexpr):
    """Quantize one bf16 row `y` [BLOCK] (zero past `width`) and store its packed codes at row `row` of
    q [M, width/2] and its block scales (uint8 view) at their swizzled places; `scale_tiles` is the number
    of 4-scale column tiles of the scale layout."""
    groups = tl.reshape(y.to(tl.float32), (BLOCK // 16, 16))
    amax = tl.max(tl.abs(groups).to(tl.int32, bitcast=True), axis=1).to(tl.float32, bitcast=True)
    g = tl.load(g_ptr)
    wanted = tl.math.div_rn(amax, 6.0) * g  # E2M1_MAX
    code = e4m3_code(tl.clamp(wanted, 0.0, 448.0, propagate_nan=tl.PropagateNan.ALL))  # FP8_MAX
    scale = e4m3_value(code)
    positive = scale > 0  # a block whose scale is 0 (or NaN) gets zero codes, with no division by 0
    factor = tl.where(positive, tl.math.div_rn(tl.zeros_like(scale) + g, tl.where(positive, scale, 1.0)), 0.0)
    codes = e2m1_code(groups * factor[:, None])
    low, high = tl.split(tl.reshape(codes, (BLOCK // 2, 2)))
    pairs = tl.arange(0, BLOCK // 2)
    tl.store(q_ptr + row * (width // 2) + pairs, (low | (high << 4)).to(tl.uint8), mask=pairs < width // 2)
    col = tl.arange(0, BLOCK // 16)
    tile = (row // 128) * scale_tiles + col // 4
    offset = tile * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4
    tl.store(s_ptr + offset, code.to(tl.uint8), mask=col < width // 16)


@jit()
def _nvfp4_quant_kernel(y_ptr, q_ptr, s_ptr, g_ptr, width, row_stride, scale_tiles, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y = tl.load(y_ptr + row * row_stride + cols, mask=cols < width, other=0.0)
    store_nvfp4_row(y, row, width, q_ptr, s_ptr, g_ptr, scale_tiles, BLOCK)


def nvfp4_outputs(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty packed codes [rows, width/2] and zeroed swizzled block scales (their padding stays zero)."""
    q = torch.empty(rows, width // 2, dtype=torch.uint8, device=device)
    return q, torch.zeros(swizzled_shape(rows, width // NVFP4_BLOCK), dtype=FP8_DTYPE, device=device)


def nvfp4_quant_ok(y: torch.Tensor, encode_scale: torch.Tensor) -> bool:
    """Guard: bf16 y [..., K] with contiguous rows, K % 16 == 0 and K <= MAX_K, a one-element fp32 encode
    scale, one device the kernel runs on."""
    return (
        launchable(_nvfp4_quant_kernel, y, encode_scale)
        and y.dtype == torch.bfloat16
        and y.dim() >= 2
        and y.numel() > 0
        and y.shape[-1] % NVFP4_BLOCK == 0
        and y.shape[-1] <= MAX_K
        and y.stride(-1) == 1
        and (y.dim() == 2 or y.is_contiguous())
        and encode_scale.dtype == torch.float32
        and encode_scale.numel() == 1
    )


def _launch_nvfp4_quant(y: torch.Tensor, encode_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = y.shape[-1]
    rows = y.reshape(-1, width)
    q, scales = nvfp4_outputs(rows.shape[0], width, y.device)
    block = triton.next_power_of_2(width)
    _nvfp4_quant_kernel[(rows.shape[0],)](
        rows, q, scales.view(torch.uint8), encode_scale, width, rows.stride(0), scales.shape[1] // 4,
        BLOCK=block, num_warps=max(4, min(16, block // 1024)), **NO_FMA,
    )  # fmt: skip
    return q, scales


# The consumer-side quantizer (an NVFP4 linear whose producer did not quantize for it): Triton on CUDA
# when the guard accepts, else the twin.
nvfp4_quant = FusedOp(nvfp4_quant_torch, _launch_nvfp4_quant, nvfp4_quant_ok)
nvfp4_quant_triton = nvfp4_quant.triton
