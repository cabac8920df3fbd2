"""The merged Q/K/V FP8 GEMM on CUDA (rowwise-scaled `_scaled_mm`) against the separate linears
(tensorwise `_scaled_mm`), on integer data where every product and sum is exact in fp32: any difference
is a wiring error (scale placement, bias, column split), not rounding."""

import pytest
import torch
from test_fusion_gate import integer_fp8_linear

from models.fusion import configure_merged_projection

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 10, 4096])
def test_merged_qkv_equals_separate_linears_on_cuda(rows):
    device = torch.device("cuda")
    shapes = ((3072, 1, 0.25), (3072, 2, 2.0), (1024, 3, 1.0))  # out_features, seed, weight_scale
    linears = [integer_fp8_linear(n, seed, 0.5, ws).to(device) for n, seed, ws in shapes]
    for linear in linears:
        linear.post_load_weights()
    x = torch.randint(-6, 7, (1, rows, 64), device=device).bfloat16()
    separate = [linear(x) for linear in linears]
    merged, decision = configure_merged_projection("qkv", [(str(i), m) for i, m in enumerate(linears)], device)
    assert decision.fused, decision.reason
    for got, want in zip(merged(x), separate, strict=True):
        assert torch.equal(got, want)
