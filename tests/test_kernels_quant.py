"""Static FP8 quantizer: torch twin vs an independent bit-level E4M3 encoder; Triton under the interpreter."""

import numpy as np
import pytest
import torch
from steps import step_distance, subnormal

import kernels.quant as quant
from kernels._triton_common import interpreted
from kernels.quant import (
    FP8_DTYPE,
    _static_quant_fp8_kernel,
    inverse_scale,
    static_quant_fp8,
    static_quant_fp8_torch,
    static_quant_fp8_triton,
)

INPUT_SCALES = [0.005, 0.03125, 0.4263392984867096, 0.4754464328289032, 1.0, 1e-3, 3.7, 448.0]

# Tests that run the Triton kernels on CPU tensors need the interpreter (conftest sets it without CUDA).
needs_interpreter = pytest.mark.skipif(
    not interpreted(_static_quant_fp8_kernel), reason="runs the kernels on CPU; tests/gpu covers CUDA"
)


def e4m3_encode(v: np.ndarray) -> np.ndarray:
    """E4M3FN bytes of fp32 `v` in integer arithmetic: nearest-even on the fp32 bits, saturate at 448."""
    u = v.astype(np.float32).view(np.uint32).astype(np.int64)
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


def interpreter_exact_range(y: torch.Tensor, inv_scale: torch.Tensor, q_ref: torch.Tensor) -> torch.Tensor:
    """Where the interpreter's fp8 result `q` of bf16 `y` is good to one step of the reference `q_ref`.

    Triton's interpreter (DESIGN §4) mis-converts subnormals, loses NaN payloads and drops the carry of a
    rounding into the exponent. So: `y` a normal bf16 (or inf), scaled into the fp8 normal range, and
    `q_ref` with a mantissa other than 0 and 7 (no carry nearby). The GPU tests cover all of it exactly.
    """
    mantissa = q_ref.view(torch.uint8) & 7
    in_range = ~subnormal(y) & ((y.float() * inv_scale).abs() >= 2.0**-6)
    return in_range & (mantissa != 0) & (mantissa != 7)


def all_bf16() -> torch.Tensor:
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_encoder_on_hand_computed_e4m3_values():
    values = [448.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 2.0**-6, 1.0, -0.0, 240.0, 17.0, 19.0, float("nan")]
    expected = [0x7E, 0x01, 0x00, 0x01, 0x08, 0x38, 0x80, 0x77, 0x58, 0x5A, 0x7F]
    assert e4m3_encode(np.array(values, dtype=np.float32)).tolist() == expected


def test_inverse_scale_is_one_ieee_fp32_division():
    for s in INPUT_SCALES:
        for shape in ((), (1,)):
            inv = inverse_scale(torch.tensor(s, dtype=torch.float32).reshape(shape))
            assert inv.dtype == torch.float32 and inv.shape == (1,)
            assert inv.item() == np.float32(1.0) / np.float32(s)


def test_torch_quantizer_matches_bit_level_encoder_on_all_bf16():
    y = all_bf16()
    y32 = (y.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
    for s in INPUT_SCALES:
        inv32 = np.float32(1.0) / np.float32(s)
        expected = e4m3_encode(np.clip(y32 * inv32, -448.0, 448.0))
        got = static_quant_fp8_torch(y, inverse_scale(torch.tensor(s))).view(torch.uint8).numpy()
        mismatch = np.flatnonzero(got != expected)
        assert mismatch.size == 0, f"scale {s}: {mismatch.size} bytes differ, first at {mismatch[:5]}"


@needs_interpreter
def test_triton_quantizer_within_one_step_under_interpreter():
    y = all_bf16()
    for s in INPUT_SCALES:
        inv = inverse_scale(torch.tensor(s))
        got = static_quant_fp8_triton(y, inv)
        assert got is not None and got.dtype == FP8_DTYPE and got.shape == y.shape
        want = static_quant_fp8_torch(y, inv)
        assert int(step_distance(got, want)[interpreter_exact_range(y, inv, want)].max()) <= 1


@needs_interpreter
def test_triton_quantizer_keeps_shape_of_3d_input():
    y = torch.randn(2, 3, 48).bfloat16()
    got = static_quant_fp8_triton(y, inverse_scale(torch.tensor(0.01)))
    assert got.shape == y.shape


@needs_interpreter
def test_triton_quantizer_reads_row_slices_of_a_joint_sequence():
    joint = torch.randn(2, 7, 48).bfloat16()
    inv = inverse_scale(torch.tensor(0.01))
    for rows in (joint[:, 3:], joint[:, :3], joint[1:, 2:]):
        got = static_quant_fp8_triton(rows, inv)
        assert got is not None and got.is_contiguous() and got.shape == rows.shape
        want = static_quant_fp8_triton(rows.contiguous(), inv)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@needs_interpreter
@pytest.mark.parametrize(
    "y, inv",
    [
        (torch.randn(4, 32), torch.ones(1)),  # fp32 activations
        (torch.randn(32, 4).bfloat16().t(), torch.ones(1)),  # not contiguous
        (torch.randn(2, 3, 64).bfloat16()[..., :32], torch.ones(1)),  # samples not contiguous
        (torch.randn(70000, 2, 16).bfloat16()[:, :1], torch.ones(1)),  # more samples than a CUDA grid
        (torch.empty(0, 32, dtype=torch.bfloat16), torch.ones(1)),  # empty
        (torch.randn(4, 32).bfloat16(), torch.ones(1, dtype=torch.float16)),  # fp16 scale
        (torch.randn(4, 32).bfloat16(), torch.ones(2)),  # two scales
        (torch.randn(4, 32).bfloat16(), torch.ones(1, device="meta")),  # scale on another device
    ],
)
def test_quant_guard_rejects(y, inv):
    assert static_quant_fp8_triton(y, inv) is None


def test_dispatch_on_cpu_is_the_torch_twin(monkeypatch):
    def no_triton(*_):
        raise AssertionError("the CPU path must not use Triton")

    monkeypatch.setattr(quant, "static_quant_fp8_triton", no_triton)
    y = torch.randn(3, 64).bfloat16()
    inv = inverse_scale(torch.tensor(0.02))
    got, want = static_quant_fp8(y, inv), static_quant_fp8_torch(y, inv)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
