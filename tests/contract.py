"""DESIGN §4 written out step by step in numpy: the oracle the torch twins must equal bit for bit.

Independent of kernels/ and of torch's arithmetic (torch only carries bf16 and E4M3 bytes in and out).
Every fp32 step is one numpy float32 operation, so it is rounded on its own by IEEE arithmetic and never
contracted into an FMA; every narrowing is done here on the bits: bf16 round-to-nearest-even (or, to
predict Triton's CPU interpreter, truncation), E4M3 nearest-even with saturation at 448. The sums run in
the pinned order the twins use on CPU (`row_sum`, elementwise adds: not numpy's own `sum`), sqrt is
numpy's IEEE float32 sqrt, and tanh is numpy's float64 tanh rounded once to float32 (the correctly
rounded tanh on the GELU's inputs: tests/test_fp32.py). Nothing here depends on the machine.
Special values (inf, NaN, overflow) are part of the inputs, so numpy's floating-point warnings are off
inside these functions.
"""

from collections.abc import Callable

import numpy as np
import torch

F32 = np.float32
Narrow = Callable[[np.ndarray], np.ndarray]


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """uint16 encodings of a bf16 tensor."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def as_bf16(bits: np.ndarray) -> torch.Tensor:
    """bf16 tensor of uint16 encodings."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def widen(bits: np.ndarray) -> np.ndarray:
    """fp32 value of bf16 encodings (exact: the bf16 bits are the top half of the fp32 bits)."""
    return (bits.astype(np.uint32) << 16).view(F32)


def round_bf16(v: np.ndarray) -> np.ndarray:
    """bf16 encodings of fp32 `v`, round to nearest even on the bits (carries reach the exponent and inf).

    NaN gives a quiet NaN with the sign kept; torch writes another NaN encoding, see `canonical`.
    """
    u = v.astype(F32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def truncate_bf16(v: np.ndarray) -> np.ndarray:
    """bf16 encodings of fp32 `v` by dropping the low 16 bits: what Triton's interpreter does for normal
    values (DESIGN §4, upstream triton issue 8322)."""
    return (v.astype(F32).view(np.uint32) >> 16).astype(np.uint16)


def e4m3_encode(v: np.ndarray) -> np.ndarray:
    """E4M3FN bytes of fp32 `v` in integer arithmetic: nearest-even on the fp32 bits, saturate at 448."""
    u = v.astype(F32).view(np.uint32).astype(np.int64)
    sign = (u >> 31) << 7
    exp_field = (u >> 23) & 0xFF
    frac = u & 0x7FFFFF
    is_nan = (exp_field == 0xFF) & (frac != 0)
    sig = np.where(exp_field == 0, frac, frac | (1 << 23))  # |v| = sig * 2^(e - 23)
    e = np.where(exp_field == 0, -126, exp_field - 127)
    # E4M3 keeps 3 fraction bits down to exponent -6, below that a fixed unit of 2^-9 (subnormals)
    drop = np.clip(np.maximum(e - 3, -9) - (e - 23), 0, 40)
    kept = sig >> drop
    rem = sig & ((np.int64(1) << drop) - 1)
    half = np.int64(1) << (drop - 1)
    kept = kept + ((rem > half) | ((rem == half) & (kept & 1 == 1)))
    # normals: kept in [8, 16], a carry to 16 moves into the exponent field by itself
    code = np.where(e >= -6, ((e + 7) << 3) + kept - 8, kept)
    code = np.where(is_nan, 0x7F, np.minimum(code, 0x7E))
    return (code | sign).astype(np.uint8)


def row_sum(v: np.ndarray) -> np.ndarray:
    """fp32 sums over the last axis, [..., 1], in the twins' pinned order: while the width w is above 1,
    column i + ceil(w/2) is added onto column i for every i < floor(w/2), and w becomes ceil(w/2)."""
    v = v.astype(F32)
    with np.errstate(over="ignore", invalid="ignore"):
        while (width := v.shape[-1]) > 1:
            half = (width + 1) // 2
            folded = v[..., : width - half] + v[..., half:]
            v = np.concatenate([folded, v[..., width - half : half]], axis=-1)
    return v


def inverse_scale(input_scale: float) -> np.float32:
    """`fp32(1 / input_scale)` by one IEEE fp32 division."""
    return F32(1.0) / F32(input_scale)


def quantize(y_bits: np.ndarray, inv_scale: np.float32) -> np.ndarray:
    """`e4m3fn(clamp(fp32(y) * inv_s, -448, 448))`: E4M3 bytes of bf16 `y`, NaN kept."""
    with np.errstate(over="ignore", invalid="ignore"):
        return e4m3_encode(np.clip(widen(y_bits) * F32(inv_scale), F32(-448.0), F32(448.0)))


def token_rows(mod_bits: np.ndarray, mod_index: np.ndarray | None) -> np.ndarray:
    """fp32 modulation rows over the tokens: row b of [B, D] for every token of sample b ([B, 1, D]), or
    row `mod_index[b, l]` of [R, D] for token (b, l) ([B, L, D]): per-token modulation."""
    mod = widen(mod_bits)
    return mod[:, None, :] if mod_index is None else mod[mod_index]


def layer_norm(x_bits: np.ndarray, eps: float, narrow: Narrow = round_bf16) -> np.ndarray:
    """`n = bf16(x_hat)` of x [B, L, D] (bf16 encodings in, out): the LayerNorm every producer shares."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        x = widen(x_bits)
        width = F32(x.shape[-1])
        mean = row_sum(x) / width
        centered = x - mean
        var = row_sum(centered * centered) / width
        rstd = F32(1.0) / np.sqrt(var + F32(eps))
        return narrow(centered * rstd)


def layer_norm_modulate(
    x_bits: np.ndarray,
    shift_bits: np.ndarray,
    scale_bits: np.ndarray,
    eps: float,
    narrow: Narrow = round_bf16,
    mod_index: np.ndarray | None = None,
) -> np.ndarray:
    """y of producer 1 for x [B, L, D] and shift / scale rows (bf16 encodings in, out), see `token_rows`."""
    normed = layer_norm(x_bits, eps, narrow)
    with np.errstate(over="ignore", invalid="ignore"):
        one_plus_scale = F32(1.0) + token_rows(scale_bits, mod_index)
        return narrow(widen(normed) * one_plus_scale + token_rows(shift_bits, mod_index))


def gated_residual(
    residual_bits: np.ndarray,
    gate_bits: np.ndarray,
    x_bits: np.ndarray,
    narrow: Narrow = round_bf16,
    mod_index: np.ndarray | None = None,
) -> np.ndarray:
    """`r = bf16(fp32(residual) + fp32(gate) * fp32(x))` for [B, L, D] activations and gate rows."""
    with np.errstate(over="ignore", invalid="ignore"):
        return narrow(widen(residual_bits) + token_rows(gate_bits, mod_index) * widen(x_bits))


def gelu_tanh(h_bits: np.ndarray) -> np.ndarray:
    """GELU(tanh) of kernels/gelu_quant.py's contract: the constants rounded to fp32, tanh correctly
    rounded to fp32 (numpy's float64 tanh, rounded once)."""
    with np.errstate(over="ignore", invalid="ignore"):
        x = widen(h_bits)
        inner = F32(0.7978845608028654) * (x + F32(0.044715) * ((x * x) * x))
        t = np.tanh(inner.astype(np.float64)).astype(F32)
        return round_bf16((F32(0.5) * x) * (F32(1.0) + t))


def rms_norm_rope(
    x_bits: np.ndarray, weight_bits: np.ndarray, rope: np.ndarray, eps: float, narrow: Narrow = round_bf16
) -> np.ndarray:
    """kernels/qk_norm_rope.py's contract for x [B, S, H, D], weight [D] (bf16 encodings) and rope
    [S, D/2, 2] fp32 (cos, sin): rstd from the pinned sum of squares, n, w, the rotated pairs."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        x = widen(x_bits)
        var = row_sum(x * x) / F32(x.shape[-1])
        rstd = F32(1.0) / np.sqrt(var + F32(eps))
        n = widen(narrow(x * rstd))
        w = widen(narrow(n * widen(weight_bits)))
        a, b = w[..., 0::2], w[..., 1::2]
        cos, sin = rope[:, None, :, 0], rope[:, None, :, 1]  # [S, 1, D/2]: the same for every head
        real, imag = narrow(a * cos - b * sin), narrow(a * sin + b * cos)
        return np.stack([real, imag], axis=-1).reshape(x.shape)


def tanh_rows(gate_bits: np.ndarray) -> np.ndarray:
    """Qwen-Image 2.1's `t = fp32(tanh(gate))`: numpy's float64 tanh rounded to fp32 once (DESIGN §4.1)."""
    with np.errstate(invalid="ignore"):
        return np.tanh(widen(gate_bits).astype(np.float64)).astype(F32)


def layer_norm_scale(
    x_bits: np.ndarray, scale_bits: np.ndarray, index: np.ndarray, eps: float, narrow: Narrow = round_bf16
) -> np.ndarray:
    """2.1 producer (a): `y = bf16(fp32(n) * (1 + fp32(scale[row])))` for x [B, L, D], scale rows [R, D] and
    each token's row `index` [B, L]."""
    normed = layer_norm(x_bits, eps, narrow)
    with np.errstate(over="ignore", invalid="ignore"):
        return narrow(widen(normed) * (F32(1.0) + widen(scale_bits)[index]))


def tanh_gated_residual(
    residual_bits: np.ndarray,
    tanh_gate: np.ndarray,
    index: np.ndarray,
    x_bits: np.ndarray,
    narrow: Narrow = round_bf16,
) -> np.ndarray:
    """2.1's `r = bf16(fp32(residual) + t[row] * fp32(x))` with fp32 tanh rows `t` [R, D] (`tanh_rows`)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return narrow(widen(residual_bits) + tanh_gate[index] * widen(x_bits))


def silu_mul(g_bits: np.ndarray, p_bits: np.ndarray, narrow: Narrow = round_bf16) -> np.ndarray:
    """2.1 producer (c): `y = bf16(v / (1 + e) * fp32(p))`, v = fp32(g), e = numpy's float64 exp(-v) rounded
    to fp32 once."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = widen(g_bits)
        e = np.exp(-v.astype(np.float64)).astype(F32)
        return narrow(v / (F32(1.0) + e) * widen(p_bits))


def as_e4m3(codes: np.ndarray) -> torch.Tensor:
    """float8_e4m3fn tensor of uint8 encodings."""
    return torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn)


_CANONICAL_NAN = {torch.bfloat16: (torch.int16, 0x7FC0), torch.float8_e4m3fn: (torch.uint8, 0x7F)}


def canonical(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a bf16 or E4M3 tensor with every NaN as one encoding. The contract says NaN stays
    NaN, not which NaN: torch's fp32 -> bf16 writes 0xFFFF for any NaN, and the sign of that NaN then
    reaches the E4M3 byte."""
    int_dtype, nan_code = _CANONICAL_NAN[t.dtype]
    return torch.where(t.isnan(), torch.tensor(nan_code, dtype=int_dtype), t.view(int_dtype))


def assert_same_encodings(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """torch.equal on the encodings (NaN as one code), saying how many values differ when they do."""
    got, want = canonical(got), canonical(want)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: {int((got != want).sum())} of {want.numel()} values differ"
