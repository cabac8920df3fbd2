"""The DESIGN §4 fusion gate: every refusal reason, and the fused configuration it grants."""

from unittest import mock

import pytest
import torch
from torch import nn

from qwen_image_fusion.models.family import FamilyTransformer, FusionBlock
from qwen_image_fusion.models.fp8 import Fp8Linear
from qwen_image_fusion.models.fusion import FusionReport, PathDecision, configure_norm_quant, gate_path
from qwen_image_fusion.models.qwen_image.transformer import NormModulate

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
    decision = configure_norm_quant(producer, "p", qkv(0.5, 0.5, 0.5), CPU, enabled=True)
    assert decision.fused and producer.quant is not None
    assert producer.quant.inv_scale.item() == 2.0
    decision = configure_norm_quant(producer, "p", qkv(0.5, 0.5, 0.5), CPU, enabled=False)
    assert not decision.fused and producer.quant is None and "switched off" in decision.reason
    decision = configure_norm_quant(producer, "p", [("to_q", nn.Linear(4, 4))], CPU, enabled=True)
    assert not decision.fused and "not quantized" in decision.reason


def test_report_summary_counts_and_groups_reasons():
    report = FusionReport(
        block=(PathDecision("a", True), PathDecision("b", False, "why"), PathDecision("c", False, "why")),
        mlp=(),
    )
    summary = report.summary()
    assert summary.splitlines()[0] == "FP8 norm+quant fusion: 1/3 block paths"
    assert "unfused (2): why; e.g. b" in summary


@pytest.mark.parametrize("family", ["qwen-image", "qwen-image-2.1"])
def test_each_familys_transformer_keeps_the_family_contract(family: str) -> None:
    """models/family.py's FamilyTransformer and FusionBlock protocols, on a tiny transformer of each family
    built from its config class (every block a FusionBlock whose paths the gate reports)."""
    if family == "qwen-image":
        from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
        from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer

        tiny = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 6, 6))
        model = QwenImageTransformer(QwenImageConfig(**tiny))
    else:
        from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
        from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer

        tiny = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 6, 6))
        model = QwenImage21Transformer(QwenImage21Config(**tiny, context_in_dim=32))
    assert isinstance(model, FamilyTransformer) and not model.is_fp8
    assert all(isinstance(block, FusionBlock) for block in model.transformer_blocks)
    report = model.post_load_weights(fuse=True)
    paths = sum(len(block.producer_paths()) for block in model.transformer_blocks)
    assert model.fusion_report is report and len(report.block) + len(report.mlp) == paths
    assert not report.fused  # BF16 weights: nothing to fuse
    assert not isinstance(nn.Linear(2, 2), FamilyTransformer)
