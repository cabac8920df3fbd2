"""The DESIGN §4 fusion gate: every refusal reason, and the fused configuration it grants."""

from unittest import mock

import pytest
import torch
from torch import nn

from models.fp8 import Fp8Linear
from models.fusion import (
    FusionReport,
    PathDecision,
    configure_fp8_norm_quant,
    configure_merged_projection,
    gate_path,
)
from models.transformer import NormModulate

CPU = torch.device("cpu")


def fp8_linear(scale: float | torch.Tensor = 0.5) -> Fp8Linear:
    linear = Fp8Linear(32, 16)
    linear.input_scale = nn.Parameter(torch.as_tensor(scale, dtype=torch.float32), requires_grad=False)
    linear.post_load_weights()
    return linear


def qkv(*scales) -> list[tuple[str, nn.Module]]:
    return [(name, fp8_linear(s)) for name, s in zip(("to_q", "to_k", "to_v"), scales, strict=True)]


def test_shared_valid_scales_are_fused():
    reason, spec, write_y = gate_path(CPU, qkv(0.5, 0.5, 0.5))
    assert reason == ""
    assert spec is not None and spec.input_scale.item() == 0.5
    assert write_y is False


@pytest.mark.parametrize(
    ("consumers", "expected"),
    [
        (lambda: qkv(0.5, 0.5, 0.25), "input scales of to_q and to_v differ"),
        (lambda: qkv(0.0, 0.0, 0.0), "not finite and > 0"),
        (lambda: qkv(-1.0, -1.0, -1.0), "not finite and > 0"),
        (lambda: qkv(float("nan"), float("nan"), float("nan")), "not finite and > 0"),
        (lambda: qkv(float("inf"), float("inf"), float("inf")), "not finite and > 0"),
        (lambda: [("to_q", nn.Linear(32, 16))], "consumer to_q is not a ModelOpt FP8 linear"),
    ],
)
def test_refusals(consumers, expected):
    reason, spec, _ = gate_path(CPU, consumers())
    assert expected in reason
    assert spec is None


def test_fp16_and_two_element_scales_are_refused():
    half = fp8_linear()
    half.input_scale = nn.Parameter(torch.tensor(0.5, dtype=torch.float16), requires_grad=False)
    assert "float16, not float32" in gate_path(CPU, [("to_q", half)])[0]
    pair = fp8_linear()
    pair.input_scale = nn.Parameter(torch.tensor([0.5, 0.5]), requires_grad=False)
    assert "2 elements" in gate_path(CPU, [("to_q", pair)])[0]


def test_unquantized_input_needs_a_producer_that_writes_it():
    consumers = qkv(0.5, 0.5, 0.5)
    consumers[1][1].needs_unquantized_input = True
    assert "to_k needs the unquantized input" in gate_path(CPU, consumers, producer_writes_y=False)[0]
    reason, _, write_y = gate_path(CPU, consumers, producer_writes_y=True)
    assert reason == "" and write_y is True


def test_per_token_modulation_is_refused():
    assert "zero_cond_t" in gate_path(CPU, qkv(0.5, 0.5, 0.5), per_token_modulation=True)[0]


def test_unvalidated_cuda_capability_is_refused():
    cuda = torch.device("cuda", 0)
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 9)):
        assert "CUDA capability 8.9 is not a validated FP8 target" in gate_path(cuda, qkv(1, 1, 1))[0]
    for capability in ((9, 0), (10, 0), (12, 1)):
        with mock.patch("torch.cuda.get_device_capability", return_value=capability):
            # Passes the device check, then stops at the scale's device (the test scales live on the CPU).
            assert "is on cpu, not cuda:0" in gate_path(cuda, qkv(1, 1, 1))[0]


def test_configure_sets_and_clears_the_producer():
    producer = NormModulate()
    decision = configure_fp8_norm_quant(producer, "p", qkv(0.5, 0.5, 0.5), CPU, enabled=True)
    assert decision.fused and producer.quant is not None
    assert producer.quant.inv_scale.item() == 2.0
    decision = configure_fp8_norm_quant(producer, "p", qkv(0.5, 0.5, 0.5), CPU, enabled=False)
    assert not decision.fused and producer.quant is None and "switched off" in decision.reason
    decision = configure_fp8_norm_quant(producer, "p", [("to_q", nn.Linear(4, 4))], CPU, enabled=True)
    assert not decision.fused and "not quantized" in decision.reason


def test_report_summary_counts_and_groups_reasons():
    report = FusionReport(
        block=(PathDecision("a", True), PathDecision("b", False, "why"), PathDecision("c", False, "why")),
        mlp=(),
    )
    summary = report.summary()
    assert summary.splitlines()[0] == "FP8 norm+quant fusion: 1/3 block paths"
    assert "unfused (2): why; e.g. b" in summary


def integer_fp8_linear(out_features: int, seed: int, scale: float, weight_scale: float) -> Fp8Linear:
    """An FP8 linear with small integer weights and bias: every product and sum is exact in fp32, so
    the result does not depend on the GEMM's summation order."""
    g = torch.Generator().manual_seed(seed)
    linear = Fp8Linear(64, out_features)
    linear.weight.data = torch.randint(-4, 5, (out_features, 64), generator=g).float().to(torch.float8_e4m3fn)
    linear.weight_scale.data = torch.tensor(weight_scale)
    linear.input_scale.data = torch.tensor(scale)
    linear.bias.data = torch.randint(-8, 9, (out_features,), generator=g).bfloat16()
    linear.post_load_weights()
    return linear


def test_merged_qkv_equals_the_separate_linears_and_shares_their_weights():
    shapes = ((32, 1, 0.25), (16, 2, 2.0), (48, 3, 1.0))  # out_features, seed, weight_scale
    linears = [integer_fp8_linear(n, seed, 0.5, ws) for n, seed, ws in shapes]
    x = torch.randint(-6, 7, (2, 5, 64)).bfloat16()  # x / 0.5 stays an exact E4M3 value
    separate = [linear(x) for linear in linears]
    before = [linear.weight.detach().clone() for linear in linears]
    named = [(f"l{i}", m) for i, m in enumerate(linears)]
    merged, decision = configure_merged_projection("img_qkv", named, CPU)
    assert decision.fused and merged is not None
    for linear, weight in zip(linears, before, strict=True):
        assert torch.equal(linear.weight.view(torch.uint8), weight.view(torch.uint8))
        assert linear.weight.untyped_storage().data_ptr() == merged.weight.untyped_storage().data_ptr()
    outs = merged(x)
    assert [o.shape for o in outs] == [(2, 5, 32), (2, 5, 16), (2, 5, 48)]
    for got, want in zip(outs, separate, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(outs, (linear(x) for linear in linears), strict=True):
        assert torch.equal(got, want)  # the separate linears still work on their weight views


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda ls: ls.__setitem__(1, ("to_k", nn.Linear(32, 16))), "to_k is not a ModelOpt FP8 linear"),
        (lambda ls: ls[2][1].input_scale.data.fill_(0.25), "input scales of to_q and to_v differ"),
        (lambda ls: ls[0][1].input_scale.data.fill_(float("nan")), "input_scale of to_q is nan"),
    ],
)
def test_merged_qkv_refusals(edit, expected):
    linears = qkv(0.5, 0.5, 0.5)
    edit(linears)
    merged, decision = configure_merged_projection("txt_qkv", linears, CPU)
    assert merged is None and not decision.fused and expected in decision.reason


def test_merged_qkv_switch_and_report(monkeypatch):
    monkeypatch.setenv("QWEN_IMAGE_FP8_MERGED_QKV", "0")
    merged, decision = configure_merged_projection("img_qkv", qkv(0.5, 0.5, 0.5), CPU)
    assert merged is None and "QWEN_IMAGE_FP8_MERGED_QKV=0" in decision.reason
    report = FusionReport((), (), (PathDecision("a.img_qkv", True), decision))
    assert report.summary().splitlines()[1:] == [
        "FP8 Q/K/V as one GEMM: 1/2 streams",
        "  unfused (1): switched off (QWEN_IMAGE_FP8_MERGED_QKV=0); e.g. img_qkv",
    ]
