"""GELU(tanh) + static FP8 quant: twin vs float64, Triton (interpreter) fused vs unfused and vs the twin."""

import numpy as np
import pytest
import torch
from steps import ordered_codes, step_distance, subnormal
from test_kernels_quant import all_bf16, interpreter_exact_range, needs_interpreter

import qwen_image_fusion.kernels.gelu_quant as gelu_quant
from qwen_image_fusion.kernels.gelu_quant import (
    GELU_CUBIC,
    SQRT_2_OVER_PI,
    gelu_tanh,
    gelu_tanh_quant,
    gelu_tanh_quant_torch,
    gelu_tanh_quant_triton,
    gelu_tanh_torch,
    gelu_tanh_triton,
)
from qwen_image_fusion.kernels.quant import (
    FP8_DTYPE,
    inverse_scale,
    static_quant_fp8_torch,
    static_quant_fp8_triton,
)

# absolute slack on t: 8 ulp of values near 1, above the tanh error (<= 2 ulp) plus the fp32 error of `inner`
TANH_SLACK = 2.0**-21


def within_tanh_slack(g: torch.Tensor, h: torch.Tensor, tol: int) -> torch.Tensor:
    """Mask: bf16 `g` is the contract's GELU of `h` for some tanh within TANH_SLACK of the float64 tanh,
    give or take `tol` bf16 steps. NaN must match NaN.

    With t near -1, `1 + t` cancels and one ulp of t moves g by many bf16 steps; this bounds g by the
    contract's fp32 chain evaluated at t -/+ TANH_SLACK (g is monotone in t).
    """
    x = h.float()
    t64 = torch.tanh(SQRT_2_OVER_PI * (h.double() + GELU_CUBIC * h.double() ** 3))
    bounds = [(0.5 * x * (1.0 + (t64 + d).float())).bfloat16() for d in (-TANH_SLACK, 0.0, TANH_SLACK)]
    codes = torch.stack([ordered_codes(b)[0] for b in bounds])
    code, nan = ordered_codes(g)
    ref_nan = torch.stack(bounds).isnan().any(0)  # NaN in, or -inf * (1 + tanh(-inf)) = -inf * 0
    inside = (code >= codes.min(0).values - tol) & (code <= codes.max(0).values + tol)
    return torch.where(ref_nan, nan, inside & ~nan)


def gelu_inputs() -> torch.Tensor:
    """Every bf16 encoding, then normal data at the MLP's scale: [2, 4, 12288]."""
    g = torch.Generator().manual_seed(0)
    normal = (3 * torch.randn(2 * 4 * 12288 - (1 << 16), generator=g)).bfloat16()
    return torch.cat([all_bf16(), normal]).reshape(2, 4, 12288)


@pytest.mark.numerics
def test_twin_is_the_contract_gelu():
    h = gelu_inputs()
    assert bool(within_tanh_slack(gelu_tanh_torch(h), h, tol=0).all())
    # and close to torch's own tanh-GELU where no cancellation happens
    moderate = h.float().abs() < 3
    ref = torch.nn.functional.gelu(h.float(), approximate="tanh").bfloat16()
    assert int(step_distance(gelu_tanh_torch(h), ref)[moderate].max()) <= 1


@needs_interpreter
def test_fused_equals_unfused_and_twin():
    h = gelu_inputs()
    inv = inverse_scale(torch.tensor(0.03125))
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN inputs, in the interpreter's numpy
        g_unfused = gelu_tanh_triton(h)
        q_unfused = static_quant_fp8_triton(g_unfused, inv)
        g_fused, q_fused = gelu_tanh_quant_triton(h, inv, write_g=True)
        no_g, q_only = gelu_tanh_quant_triton(h, inv)
    assert no_g is None and q_fused.dtype == FP8_DTYPE
    assert torch.equal(g_fused.view(torch.int16), g_unfused.view(torch.int16))
    for q in (q_fused, q_only):
        assert torch.equal(q.view(torch.uint8), q_unfused.view(torch.uint8))
    # the interpreter truncates fp32 -> bf16 and mis-converts subnormals both ways (DESIGN §4)
    readable = ~subnormal(h) & ~subnormal(gelu_tanh_torch(h))
    assert bool(within_tanh_slack(g_fused, h, tol=1)[readable].all())
    q_ref = static_quant_fp8_torch(g_fused, inv)
    assert int(step_distance(q_fused, q_ref)[interpreter_exact_range(g_fused, inv, q_ref)].max()) <= 1


@needs_interpreter
@pytest.mark.parametrize(
    "h, inv",
    [
        (torch.randn(4, 32), torch.ones(1)),  # fp32
        (torch.randn(32, 4).bfloat16().t(), torch.ones(1)),  # not contiguous
        (torch.empty(0, 32, dtype=torch.bfloat16), torch.ones(1)),  # empty
        (torch.randn(4, 32).bfloat16(), torch.ones(2)),  # two scales
    ],
)
def test_gelu_guards_reject(h, inv):
    assert gelu_tanh_quant_triton(h, inv) is None
    if inv.numel() == 1:
        assert gelu_tanh_triton(h) is None


def test_dispatch_on_cpu_is_the_torch_twin(monkeypatch):
    def no_triton(*_):
        raise AssertionError("the CPU path must not use Triton")

    monkeypatch.setattr(gelu_quant, "gelu_tanh_quant_triton", no_triton)
    h = (3 * torch.randn(4, 256)).bfloat16()
    inv = inverse_scale(torch.tensor(0.03))
    g, q = gelu_tanh_quant(h, inv, write_g=True)
    assert torch.equal(g.view(torch.int16), gelu_tanh_torch(h).view(torch.int16))
    assert torch.equal(q.view(torch.uint8), gelu_tanh_quant_torch(h, inv).view(torch.uint8))
    with pytest.raises(TypeError, match="bf16 input expected"):  # the contract is defined on bf16 inputs
        gelu_tanh(h.float())
