"""Static FP8 quantizer: the bit-level E4M3 encoder of tests/contract.py on hand-computed values, the inverse
scale, Triton under the interpreter. The twin against the encoder on all bf16: test_kernels_contract.py."""

import numpy as np
import pytest
import torch
from contract import e4m3_encode
from steps import step_distance, subnormal

import qwen_image_fusion.kernels.quant as quant
from qwen_image_fusion.kernels.quant import (
    FP8_DTYPE,
    inverse_scale,
    static_quant_fp8,
    static_quant_fp8_torch,
    static_quant_fp8_triton,
)

INPUT_SCALES = [0.005, 0.03125, 0.4263392984867096, 0.4754464328289032, 1.0, 1e-3, 3.7, 448.0]

# Tests that run the Triton kernels on CPU tensors need the interpreter (conftest sets it without CUDA,
# and fails these tests under CI=true when it is off).
needs_interpreter = pytest.mark.interpreter


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


@pytest.mark.numerics
def test_inverse_scale_is_one_ieee_fp32_division():
    for s in INPUT_SCALES:
        for shape in ((), (1,)):
            inv = inverse_scale(torch.tensor(s, dtype=torch.float32).reshape(shape))
            assert inv.dtype == torch.float32 and inv.shape == (1,)
            assert inv.item() == np.float32(1.0) / np.float32(s)


@needs_interpreter
def test_triton_quantizer_within_one_step_under_interpreter():
    y = all_bf16()
    for s in INPUT_SCALES:
        inv = inverse_scale(torch.tensor(s))
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN inputs, in the interpreter's numpy
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
