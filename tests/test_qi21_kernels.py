"""Qwen-Image 2.1 producers under Triton's CPU interpreter: fused == unfused bit for bit (one binary, runtime
flags), against the torch twins within the interpreter's slack (DESIGN §4: it truncates fp32 -> bf16), and
against tests/contract.py bit for bit on rows whose LN sums are exact in any order; guards and dispatch."""

import contract
import numpy as np
import pytest
import torch
from steps import ordered_codes, step_distance, subnormal
from test_kernels_norm_modulate import (
    EPS,
    exact_statistics_rows,
    explained_by_ln_statistics,
    make_inputs,
    same_bytes,
)
from test_kernels_quant import all_bf16, interpreter_exact_range, needs_interpreter

import qwen_image_fusion.kernels.scale_modulate as scale_modulate
import qwen_image_fusion.kernels.swiglu_quant as swiglu_quant
from qwen_image_fusion.kernels._triton_common import MAX_WIDTH
from qwen_image_fusion.kernels.quant import inverse_scale, static_quant_fp8_torch, static_quant_fp8_triton
from qwen_image_fusion.kernels.scale_modulate import (
    layer_norm_scale,
    layer_norm_scale_torch,
    layer_norm_scale_triton,
    tanh_gated_residual_torch,
    tanh_gated_residual_triton,
    tanh_residual_layer_norm_scale_torch,
    tanh_residual_layer_norm_scale_triton,
    tanh_rows,
)
from qwen_image_fusion.kernels.swiglu_quant import (
    silu_mul_quant,
    silu_mul_quant_torch,
    silu_mul_quant_triton,
    silu_mul_torch,
    silu_mul_triton,
    silu_torch,
)

# (batch, tokens, width): an odd multiple of 16, the 2.1 width, the largest block
SHAPES = [(2, 3, 48), (2, 3, 4096), (1, 2, MAX_WIDTH)]
EXP_SLACK = 2.0**-20  # relative: 8 ulp of exp(-v), above libdevice expf (2 ulp) and numpy's fp32 exp


def inputs21(batch: int, tokens: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """Activations of tests/test_kernels_norm_modulate.py, B + 1 modulation rows (the last one t = 0) as
    strided chunks of one [B + 1, 4D] tensor like 2.1's shared projection, the first token reading row B."""
    t = make_inputs(batch, tokens, width, seed)
    g = torch.Generator().manual_seed(seed + 1)
    mod = (0.5 * torch.randn(batch + 1, 4 * width, generator=g)).bfloat16()
    index = torch.arange(batch, dtype=torch.int32).view(batch, 1).repeat(1, tokens)
    index[:, 0] = batch
    return {**t, "scale": mod[:, :width], "gate": mod[:, width : 2 * width], "index": index}


def explained_scale_only(y, ln_input, scale, index, interpreter: bool) -> torch.Tensor:
    """`explained_by_ln_statistics` for scale-only modulation with per-token rows: each token is a sample of
    one row, and a shift of -0.0 leaves `n * (1 + scale)` unchanged (x + -0.0 = x for every x)."""
    batch, tokens, width = y.shape
    rows = scale[index.long()].reshape(batch * tokens, width)
    flat = [t.reshape(batch * tokens, 1, width) for t in (y, ln_input)]
    neg_zero = torch.full_like(rows, -0.0)
    return explained_by_ln_statistics(*flat, neg_zero, rows, interpreter).reshape(y.shape)


def within_exp_slack(y: torch.Tensor, g: torch.Tensor, p: torch.Tensor, tol: int) -> torch.Tensor:
    """Mask: bf16 `y` is the contract's SwiGLU of (g, p) for some fp32 exp(-v) within EXP_SLACK of the
    float64 one, give or take `tol` bf16 steps; NaN must match NaN. s = v / (1 + e) is monotone in e and
    y = bf16(s * p) in s, so the two ends bound y."""
    v, pf = g.float(), p.float()
    e64 = torch.exp(-g.double())
    bounds = [(v / (1.0 + (e64 * (1 + d)).float()) * pf).bfloat16() for d in (-EXP_SLACK, 0.0, EXP_SLACK)]
    codes = torch.stack([ordered_codes(b)[0] for b in bounds])
    code, nan = ordered_codes(y)
    ref_nan = torch.stack(bounds).isnan().any(0)
    inside = (code >= codes.min(0).values - tol) & (code <= codes.max(0).values + tol)
    return torch.where(ref_nan, nan, inside & ~nan)


@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_scale_fused_equals_unfused_and_twin(shape):
    t = inputs21(*shape, seed=shape[-1])
    inv = inverse_scale(torch.tensor(0.02))
    args = (t["x"], t["scale"], t["index"], EPS)
    y_unfused, no_q = layer_norm_scale_triton(*args)
    q_unfused = static_quant_fp8_triton(y_unfused, inv)
    y_fused, q_fused = layer_norm_scale_triton(*args, inv)
    no_y, q_only = layer_norm_scale_triton(*args, inv, write_y=False)
    assert no_q is None and no_y is None
    assert same_bytes(y_fused, y_unfused)
    assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)
    assert bool(explained_scale_only(y_fused, t["x"], t["scale"], t["index"], interpreter=True).all())
    q_ref = static_quant_fp8_torch(y_fused, inv)
    assert int(step_distance(q_fused, q_ref)[interpreter_exact_range(y_fused, inv, q_ref)].max()) <= 1


@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES)
def test_tanh_residual_layer_norm_scale_fused_equals_unfused_and_twin(shape):
    t = inputs21(*shape, seed=shape[-1] + 1)
    tanh_gate = tanh_rows(t["gate"])
    args = (t["residual"], tanh_gate, t["x"], t["scale"], t["index"], EPS)
    inv = inverse_scale(torch.tensor(0.05))
    r_unfused, y_unfused, no_q = tanh_residual_layer_norm_scale_triton(*args)
    q_unfused = static_quant_fp8_triton(y_unfused, inv)
    r_fused, y_fused, q_fused = tanh_residual_layer_norm_scale_triton(*args, inv)
    r_only_q, no_y, q_only = tanh_residual_layer_norm_scale_triton(*args, inv, write_y=False)
    assert no_q is None and no_y is None
    residual_only = tanh_gated_residual_triton(t["residual"], tanh_gate, t["x"], t["index"])
    for r in (r_fused, r_only_q, residual_only):
        assert same_bytes(r, r_unfused)
    assert same_bytes(y_fused, y_unfused)
    assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)
    r_ref = tanh_gated_residual_torch(t["residual"], tanh_gate, t["x"], t["index"])
    assert int(step_distance(r_fused, r_ref).max()) <= 1  # the interpreter truncates
    assert bool(explained_scale_only(y_fused, r_fused, t["scale"], t["index"], interpreter=True).all())
    q_ref = static_quant_fp8_torch(y_fused, inv)
    assert int(step_distance(q_fused, q_ref)[interpreter_exact_range(y_fused, inv, q_ref)].max()) <= 1


@needs_interpreter
def test_producers_equal_the_contract_under_interpreter_with_exact_statistics():
    """y and r byte for byte against tests/contract.py with truncation as the bf16 rounding (what the
    interpreter does for normal values): with order-independent LN sums nothing else is free, so every
    rounding step of the kernels is checked (a dropped `bf16(x_hat)` or a wrong modulation row fails)."""
    x = exact_statistics_rows(2, 4, 1024, seed=20)
    t = inputs21(2, 4, 1024, seed=21)
    bits, index = contract.bf16_bits, t["index"].numpy()
    y, _ = layer_norm_scale_triton(x, t["scale"], t["index"], EPS)
    want = contract.layer_norm_scale(bits(x), bits(t["scale"]), index, EPS, contract.truncate_bf16)
    contract.assert_same_encodings(y, contract.as_bf16(want), "producer (a) y")

    tanh_gate = tanh_rows(t["gate"])
    args = (t["residual"], tanh_gate, t["x"], t["scale"], t["index"], EPS)
    r, _, _ = tanh_residual_layer_norm_scale_triton(*args)
    r_want = contract.tanh_gated_residual(
        bits(t["residual"]), tanh_gate.numpy(), index, bits(t["x"]), contract.truncate_bf16
    )
    contract.assert_same_encodings(r, contract.as_bf16(r_want), "producer (b) r")
    # the LN path of producer (b) on r = 0 + 1 * x = x (gate rows whose tanh is exactly 1)
    one = torch.ones(3, 1024)
    r, y, _ = tanh_residual_layer_norm_scale_triton(torch.zeros_like(x), one, x, t["scale"], t["index"], EPS)
    contract.assert_same_encodings(r, x, "producer (b) r = x")
    contract.assert_same_encodings(y, contract.as_bf16(want), "producer (b) y")


def swiglu_inputs(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(g, p) [2, 8, 4096]: g every bf16 encoding against normal data, then p every encoding."""
    g = torch.Generator().manual_seed(seed)
    normal = (3 * torch.randn(1 << 16, generator=g)).bfloat16().reshape(2, 8, 4096)
    every = all_bf16().reshape(2, 8, 4096)
    return [(every, normal), (normal, every)]


def interpreter_readable(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mask where the interpreter's SwiGLU can be compared: no subnormal operand, and the fp32 `s` and `s * p`
    zero or normal (the interpreter mishandles subnormals, DESIGN §4)."""
    s = silu_torch(g)
    normal_or_zero = [(v == 0) | (v.abs() >= 2.0**-126) | ~v.isfinite() for v in (s, s * p.float())]
    return ~subnormal(g) & ~subnormal(p) & normal_or_zero[0] & normal_or_zero[1]


@needs_interpreter
def test_silu_mul_fused_equals_unfused_and_twin():
    inv = inverse_scale(torch.tensor(0.03125))
    for g, p in swiglu_inputs(seed=22):
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN inputs, in the interpreter's numpy
            y_unfused = silu_mul_triton(g, p)
            q_unfused = static_quant_fp8_triton(y_unfused, inv)
            y_fused, q_fused = silu_mul_quant_triton(g, p, inv, write_y=True)
            no_y, q_only = silu_mul_quant_triton(g, p, inv)
        assert no_y is None
        assert same_bytes(y_fused, y_unfused)
        assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)
        assert bool(within_exp_slack(y_fused, g, p, tol=1)[interpreter_readable(g, p)].all())
        q_ref = static_quant_fp8_torch(y_fused, inv)
        assert int(step_distance(q_fused, q_ref)[interpreter_exact_range(y_fused, inv, q_ref)].max()) <= 1


def test_twins_within_the_exp_slack_and_close_to_float64():
    for g, p in swiglu_inputs(seed=23):
        y = silu_mul_torch(g, p)
        assert bool(within_exp_slack(y, g, p, tol=0).all())
        moderate = (g.float().abs() < 8) & (p.float().abs() < 8)
        y64 = (torch.nn.functional.silu(g.double()) * p.double()).bfloat16()
        assert int(step_distance(y, y64)[moderate].max()) <= 1


def _with(**changes) -> dict[str, torch.Tensor]:
    t = inputs21(2, 3, 64, seed=0)
    t.update(changes)
    return t


@needs_interpreter
@pytest.mark.parametrize(
    "t, inv",
    [
        (_with(x=torch.randn(2, 3, 64)), None),  # fp32 activations
        (_with(x=torch.randn(2, 64, 3).bfloat16().transpose(1, 2)), None),  # not contiguous
        (_with(scale=torch.randn(3, 64)), None),  # fp32 scale rows
        (_with(scale=torch.randn(64, 3).bfloat16().t()), None),  # column stride != 1
        (_with(scale=torch.randn(3, 32).bfloat16()), None),  # rows of another width
        (_with(index=torch.zeros(2, 3, dtype=torch.int64)), None),  # int64 index
        (_with(index=torch.zeros(2, 4, dtype=torch.int32)), None),  # index of another shape
        (_with(index=torch.zeros(3, 2, dtype=torch.int32).t()), None),  # index not contiguous
        (
            _with(x=torch.empty(2, 0, 64, dtype=torch.bfloat16), index=torch.zeros(2, 0, dtype=torch.int32)),
            None,
        ),
        (inputs21(2, 3, 40, seed=0), None),  # D not a multiple of 16
        (inputs21(1, 1, MAX_WIDTH + 16, seed=0), None),  # D beyond one block
        (inputs21(2, 3, 64, seed=0), torch.ones(2)),  # two scales
        (inputs21(2, 3, 64, seed=0), torch.ones(1, device="meta")),  # scale on another device
    ],
)
def test_producer_guards_reject(t, inv):
    assert layer_norm_scale_triton(t["x"], t["scale"], t["index"], EPS, inv) is None
    tanh_gate = tanh_rows(t["gate"])
    args = (t["residual"], tanh_gate, t["x"], t["scale"], t["index"], EPS, inv)
    assert tanh_residual_layer_norm_scale_triton(*args) is None


@needs_interpreter
def test_tanh_rows_must_be_fp32():
    t = inputs21(2, 3, 64, seed=0)
    args = (t["residual"], t["gate"], t["x"], t["scale"], t["index"], EPS)  # bf16 gate, not its fp32 tanh
    assert tanh_residual_layer_norm_scale_triton(*args) is None
    assert tanh_gated_residual_triton(t["residual"], t["gate"], t["x"], t["index"]) is None


@needs_interpreter
@pytest.mark.parametrize(
    "g, p, inv",
    [
        (torch.randn(4, 32), torch.randn(4, 32), torch.ones(1)),  # fp32
        (torch.randn(4, 32).bfloat16(), torch.randn(4, 16).bfloat16(), torch.ones(1)),  # shapes differ
        (torch.randn(32, 4).bfloat16().t(), torch.randn(4, 32).bfloat16(), torch.ones(1)),  # not contiguous
        (torch.empty(0, 32, dtype=torch.bfloat16), torch.empty(0, 32, dtype=torch.bfloat16), torch.ones(1)),
        (torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16(), torch.ones(2)),  # two scales
    ],
)
def test_silu_mul_guards_reject(g, p, inv):
    assert silu_mul_quant_triton(g, p, inv) is None
    if inv.numel() == 1:
        assert silu_mul_triton(g, p) is None


def test_dispatch_on_cpu_is_the_torch_twin(monkeypatch):
    def no_triton(*_):
        raise AssertionError("the CPU path must not use Triton")

    for module, name in (
        (scale_modulate, "layer_norm_scale_triton"),
        (scale_modulate, "tanh_residual_layer_norm_scale_triton"),
        (swiglu_quant, "silu_mul_quant_triton"),
    ):
        monkeypatch.setattr(module, name, no_triton)
    t = inputs21(2, 3, 256, seed=5)
    inv = inverse_scale(torch.tensor(0.02))
    got = layer_norm_scale(t["x"], t["scale"], t["index"], EPS, inv)
    want = layer_norm_scale_torch(t["x"], t["scale"], t["index"], EPS, inv)
    assert all(same_bytes(a, b) for a, b in zip(got, want, strict=True))
    args = (t["residual"], tanh_rows(t["gate"]), t["x"], t["scale"], t["index"], EPS, inv)
    got = scale_modulate.tanh_residual_layer_norm_scale(*args)
    assert all(
        same_bytes(a, b) for a, b in zip(got, tanh_residual_layer_norm_scale_torch(*args), strict=True)
    )
    y, q = silu_mul_quant(t["x"], t["residual"], inv, write_y=True)
    assert same_bytes(y, silu_mul_torch(t["x"], t["residual"]))
    assert same_bytes(q, silu_mul_quant_torch(t["x"], t["residual"], inv))
