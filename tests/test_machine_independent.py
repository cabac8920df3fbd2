"""The arithmetic of the torch twins and of the CPU FP8 GEMM against correctly rounded references that no
machine can change: Python's exact `fractions`, `decimal` at 80 digits, `math.sqrt` (IEEE), and the
numpy emulation of tests/contract.py. Every op whose rounding could depend on the CPU (sqrt, division,
tanh, sums, the fp32 -> bf16 / E4M3 narrowings, the FP8 dot products) is checked on random and edge
inputs (zeros of both signs, subnormals, the largest values, inf, NaN), and the twins give the same
bytes with 1 thread and with several (CI also reruns this module with OMP_NUM_THREADS=1 and 2).
"""

import decimal
import math
from fractions import Fraction

import contract
import numpy as np
import pytest
import torch
from test_kernels_contract import every_encoding, model_width
from test_kernels_norm_modulate import EPS
from test_qk_norm_rope import make_inputs as qk_inputs

from qwen_image_fusion.kernels.fp32 import _settle_sqrt, div_rn, row_sum, sqrt_rn
from qwen_image_fusion.kernels.gelu_quant import GELU_CUBIC, SQRT_2_OVER_PI, gelu_tanh_torch, tanh_fp32
from qwen_image_fusion.kernels.norm_modulate import gated_residual_layer_norm_modulate_torch
from qwen_image_fusion.kernels.qk_norm_rope import rms_norm_rope_torch
from qwen_image_fusion.kernels.quant import FP8_MAX, MAX_EXACT_K, exact_fp8_dot, inverse_scale
from qwen_image_fusion.models.fp8 import scaled_mm

pytestmark = pytest.mark.numerics
F32_MAX = float(np.finfo(np.float32).max)
TANH_MARGIN_ULPS = 2**17  # the margin kernels/gelu_quant.py's `tanh_fp32` relies on


def fp32_bits(count: int, seed: int) -> torch.Tensor:
    """`count` fp32 values with uniformly random bit patterns: every binade, subnormals, inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 31), 1 << 31, (count,), generator=g, dtype=torch.int64).to(torch.int32)


def random_fp32(count: int, seed: int) -> torch.Tensor:
    return fp32_bits(count, seed).view(torch.float32)


EDGES = [0.0, -0.0, 2.0**-149, 2.0**-126 - 2.0**-149, 2.0**-126, 1.0, 3.0, 0.1, F32_MAX, math.inf]
EDGES += [-v for v in EDGES[2:]] + [math.nan]


def nearest_fp32(value: Fraction) -> float:
    """The fp32 number nearest to the exact `value`, ties to even, overflowing to inf past the largest
    fp32's rounding boundary."""
    if abs(value) >= Fraction(F32_MAX) + Fraction(2) ** 103:  # the midpoint between F32_MAX and 2^128
        return math.copysign(math.inf, value)
    if value == 0:
        return 0.0
    best = float(np.float32(float(value)))  # within one fp32 step: float() rounds once, np.float32 once more
    for side in (math.inf, -math.inf):
        with np.errstate(over="ignore"):
            other = float(np.nextafter(np.float32(best), np.float32(side)))
        if math.isinf(other):  # best is the largest fp32: the overflow test above settled it
            continue
        mid = (Fraction(best) + Fraction(other)) / 2
        closer = value > mid if side > 0 else value < mid
        even_tie = value == mid and np.float32(other).view(np.uint32) % 2 == 0
        if closer or even_tie:
            return other
    return best


def exact_sqrt_fp32(v: float) -> float:
    """Correctly rounded fp32 square root of the fp32 number `v`, by exact rational comparisons."""
    if math.isnan(v) or v < 0:
        return math.nan
    if v == 0 or math.isinf(v):
        return v
    root = float(np.float32(math.sqrt(v)))  # math.sqrt is IEEE in float64: within one fp32 step
    for side in (math.inf, 0.0):
        other = float(np.nextafter(np.float32(root), np.float32(side)))
        mid = (Fraction(root) + Fraction(other)) / 2
        if (mid * mid < Fraction(v)) if side else (mid * mid > Fraction(v)):
            return other
    return root


def same_fp32(got: torch.Tensor, want: list[float]) -> bool:
    """Bit-equal fp32 values, any NaN equal to any NaN."""
    want_t = torch.tensor(want, dtype=torch.float32)
    nan = got.isnan() & want_t.isnan()
    return bool(((got.view(torch.int32) == want_t.view(torch.int32)) | nan).all())


def sqrt_inputs() -> torch.Tensor:
    """Edge values, exact squares, the fp32 numbers next to squares of midpoints (the hardest roundings,
    in several binades), and random positive fp32 numbers of every exponent."""
    g = torch.Generator().manual_seed(1)
    k = torch.randint(1 << 23, 1 << 24, (2000,), generator=g, dtype=torch.int64).double()
    scale = torch.exp2(torch.randint(-60, 60, (2000,), generator=g).double())
    squares = ((k * scale) ** 2).float()
    midpoint_squares = (((k + 0.5) * scale) ** 2).float()
    near = torch.cat([torch.nextafter(midpoint_squares, torch.tensor(d)) for d in (0.0, math.inf)])
    randoms = random_fp32(20000, seed=2).abs()
    return torch.cat([torch.tensor(EDGES), squares, midpoint_squares, near, randoms])


def test_sqrt_is_correctly_rounded():
    v = sqrt_inputs()
    want = [exact_sqrt_fp32(x) for x in v.tolist()]
    assert same_fp32(sqrt_rn(v), want)
    # the settling step alone: a candidate one fp32 step off on either side still gives the IEEE root
    want_t = torch.tensor(want, dtype=torch.float32)
    for side in (0.0, math.inf):
        off = torch.nextafter(want_t, torch.tensor(side))
        usable = want_t.isfinite() & (want_t > 0) & off.isfinite()
        assert torch.equal(_settle_sqrt(off[usable], v[usable]), want_t[usable])
    # and numpy's float32 sqrt (IEEE) on 2^22 random bit patterns
    many = random_fp32(1 << 22, seed=3).abs()
    with np.errstate(invalid="ignore"):  # NaN inputs
        ieee = torch.from_numpy(np.sqrt(many.numpy()))
    assert torch.equal(sqrt_rn(many).view(torch.int32), ieee.view(torch.int32))


def test_division_is_correctly_rounded():
    n = torch.cat([random_fp32(6000, seed=4), torch.tensor(EDGES).repeat_interleave(len(EDGES))])
    d = torch.cat([random_fp32(6000, seed=5), torch.tensor(EDGES).repeat(len(EDGES))])
    want = []
    for a, b in zip(n.tolist(), d.tolist(), strict=True):
        if math.isnan(a) or math.isnan(b) or (a == 0 and b == 0) or (math.isinf(a) and math.isinf(b)):
            want.append(math.nan)
        elif math.isinf(a) or b == 0:
            want.append(math.copysign(math.inf, a) * math.copysign(1.0, b))
        elif math.isinf(b) or a == 0:
            want.append(math.copysign(0.0, a) * math.copysign(1.0, b))
        else:
            want.append(nearest_fp32(Fraction(a) / Fraction(b)))
    assert same_fp32(div_rn(n, d), want)
    # a Python-scalar denominator (the LN's width) divides the same way
    values = n.tolist()
    for width in (3072, 128, 48, 12288):
        want = [nearest_fp32(Fraction(a) / width) if math.isfinite(a) and a else a / width for a in values]
        assert same_fp32(div_rn(n, width), want)


@pytest.mark.parametrize("width", [1, 2, 3, 7, 48, 128, 3072, 4097])
def test_row_sum_is_the_pinned_order(width):
    """Bit for bit the numpy emulation of the order (elementwise float32 adds); with special values."""
    g = torch.Generator().manual_seed(width)
    v = torch.randn(5, 3, width, generator=g) * torch.exp2(torch.randint(-20, 20, (5, 3, 1), generator=g))
    v[0, 0] = random_fp32(width, seed=width)  # any bit pattern: inf, NaN, subnormals
    v[0, 1] = -0.0
    v[1, 0, 0] = F32_MAX
    v[1, 0, -1] = F32_MAX  # overflows in some orders, not in others
    got = row_sum(v)
    want = torch.from_numpy(contract.row_sum(v.numpy()))
    assert got.shape == (5, 3, 1)
    assert torch.equal(got.view(torch.int32)[~got.isnan()], want.view(torch.int32)[~want.isnan()])
    assert torch.equal(got.isnan(), want.isnan())


def exact_tanh_fp32(value: float, context: decimal.Context) -> tuple[float, Fraction]:
    """(fp32 nearest to tanh(value), distance of tanh(value) from the nearest fp32 rounding boundary in
    float64 ulps) for finite fp32 `value` >= 0, from an 80-digit tanh: tanh(x) = (1 - e^-2x) / (1 + e^-2x),
    whose error (below 10^-70 relative, even for x near 2^-134) is far below the margins measured."""
    e = context.exp(context.multiply(decimal.Decimal(-2), decimal.Decimal(value)))
    t = Fraction(context.divide(context.subtract(1, e), context.add(1, e)))
    rounded = nearest_fp32(t)
    boundaries = [
        (Fraction(rounded) + Fraction(float(np.nextafter(np.float32(rounded), np.float32(side))))) / 2
        for side in (math.inf, 0.0)
    ]
    margin = min(abs(t - b) for b in boundaries) / Fraction(math.ulp(float(t)))
    return rounded, margin


def test_gelu_tanh_is_correctly_rounded_on_every_bf16_input():
    """Exhaustive: `tanh_fp32` on every `inner` a bf16 input gives (odd symmetry: the non-negative ones)
    equals the correctly rounded tanh, and each exact tanh is at least TANH_MARGIN_ULPS float64 ulps
    from an fp32 rounding boundary, so any float64 tanh within that many ulps rounds to the same fp32
    number: the twin's bytes do not depend on the machine's tanh."""
    x = every_encoding((1 << 16,)).float()
    inner = SQRT_2_OVER_PI * (x + GELU_CUBIC * (x * x * x))
    values = torch.unique(inner[inner.isfinite() & (inner > 0)])
    context = decimal.Context(prec=80)
    exact = [exact_tanh_fp32(v, context) for v in values.tolist()]
    assert same_fp32(tanh_fp32(values), [t for t, _ in exact])
    assert min(m for _, m in exact) >= TANH_MARGIN_ULPS
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    assert same_fp32(tanh_fp32(special), [0.0, -0.0, 1.0, -1.0, math.nan])
    assert torch.equal(tanh_fp32(-values), -tanh_fp32(values))


def test_narrowing_conversions_are_nearest_even():
    """fp32 -> bf16 and (the quantizer's clamp, then) fp32 -> E4M3 against the bit-level encoders, on
    random bit patterns (every class of value) and values next to every rounding boundary."""
    v = torch.cat([random_fp32(1 << 20, seed=6), torch.tensor(EDGES)])
    bf16 = v.to(torch.bfloat16)
    contract.assert_same_encodings(bf16, contract.as_bf16(contract.round_bf16(v.numpy())), "fp32 -> bf16")
    scaled = v * 2.0**-120  # bring the random exponents near E4M3's range
    clamped = torch.cat([v, scaled]).clamp(-FP8_MAX, FP8_MAX)
    want = contract.as_e4m3(contract.e4m3_encode(clamped.numpy()))
    contract.assert_same_encodings(clamped.to(torch.float8_e4m3fn), want, "fp32 -> e4m3")


def all_e4m3(count: int, seed: int) -> torch.Tensor:
    """`count` random E4M3 values (NaN excluded): every encoding, the largest and subnormals included."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (count,), generator=g, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    return codes.view(torch.float8_e4m3fn)


def test_fp8_gemm_emulation_sums_exactly():
    """Each dot product of the CPU `_scaled_mm` emulation equals the exact rational dot product rounded
    once to fp32, at the model's largest K (MLP down projection), with huge and tiny terms mixed."""
    k = 12288
    q = all_e4m3(3 * k, seed=7).reshape(3, k)
    w = all_e4m3(4 * k, seed=8).reshape(4, k)
    w[0] = 448.0  # rows of the largest product
    q[0] = 448.0
    got = exact_fp8_dot(q, w)
    qf, wf = ([[Fraction(v) for v in row] for row in t.float().tolist()] for t in (q, w))
    want = [[nearest_fp32(sum(a * b for a, b in zip(qr, wr, strict=True))) for wr in wf] for qr in qf]
    assert same_fp32(got.flatten(), [v for row in want for v in row])
    too_long = torch.zeros(1, MAX_EXACT_K + 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="exact limit"):
        exact_fp8_dot(too_long, too_long)


def twin_outputs() -> dict[str, torch.Tensor]:
    """Every CPU twin on inputs big enough for torch to split work over threads (one long row too)."""
    t = model_width(seed=30)
    inv = inverse_scale(torch.tensor(0.02))
    args = (t["residual"], t["gate"], t["x"], t["shift"], t["scale"], EPS, inv)
    r, y, q = gated_residual_layer_norm_modulate_torch(*args)
    long_row = every_encoding((1, 1, 1 << 16), seed=31)
    _, y_long, _ = gated_residual_layer_norm_modulate_torch(
        long_row, torch.ones(1, 1 << 16, dtype=torch.bfloat16), long_row, long_row[0], long_row[0], EPS
    )
    qk = qk_inputs(2, 256, 24, 128, seed=32)
    q8 = all_e4m3(64 * 3072, seed=33).reshape(64, 3072)
    w8 = all_e4m3(256 * 3072, seed=34).reshape(256, 3072)
    one = torch.ones(())
    return {
        "r": r,
        "y": y,
        "q": q,
        "y of one long row": y_long,
        "q/k norm + rope": rms_norm_rope_torch(qk["x"], qk["weight"], qk["rope"], EPS),
        "gelu": gelu_tanh_torch(every_encoding((4, 128, 128), seed=35)),
        "fp8 gemm": scaled_mm(q8, w8, one, one, None, torch.bfloat16),
    }


def test_twins_give_the_same_bytes_with_one_thread_and_with_several():
    threads = torch.get_num_threads()
    several = twin_outputs()
    torch.set_num_threads(1)
    try:
        one = twin_outputs()
    finally:
        torch.set_num_threads(threads)
    for name, got in one.items():
        contract.assert_same_encodings(got, several[name], f"{name}, 1 vs {threads} threads")
