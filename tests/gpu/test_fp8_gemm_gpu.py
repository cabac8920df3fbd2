"""kernels/fp8_gemm.py compiled on CUDA, at the MLP up-projection's size (4096 rows: DESIGN §4 asks fused vs
unfused at >= 4096 rows): each candidate's GELU + FP8-quant epilogue == its own bf16 output -> the
gelu_quant kernel, byte for byte, and its bf16 output close to the exact product (both accumulation modes).
Speed is bench/fp8_gemm_bench.py's."""

import pytest
import torch

from qwen_image_fusion.kernels.fp8_gemm import GemmConfig, fp8_gemm_triton, warp_specialize_available
from qwen_image_fusion.kernels.gelu_quant import gelu_tanh_quant_triton
from qwen_image_fusion.kernels.quant import FP8_DTYPE, inverse_scale

pytestmark = pytest.mark.gpu

CASES = [
    ("tiled", GemmConfig(128, 256, 128, 8, 3, 8)),
    ("tiled", GemmConfig(128, 128, 128, 8, 4, 8, precise=False)),
    ("persistent", GemmConfig(128, 128, 128, 8, 4, 8)),
    pytest.param(
        "persistent",
        GemmConfig(128, 128, 128, 8, 4, 8, warp_specialize=True),
        marks=pytest.mark.skipif(not warp_specialize_available(), reason="tl.range has no warp_specialize"),
    ),
]


@pytest.mark.parametrize("kernel, config", CASES)
def test_epilogue_equals_unfused_at_model_size(kernel, config):
    g = torch.Generator(device="cuda").manual_seed(0)
    m, n, k = 4096, 12288, 3072
    a = torch.randn(m, k, device="cuda", generator=g).clamp(-8, 8).to(FP8_DTYPE)
    w = torch.randn(n, k, device="cuda", generator=g).clamp(-8, 8).to(FP8_DTYPE)
    bias = (0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    sa, sb = torch.tensor([0.1], device="cuda"), torch.tensor([0.2], device="cuda")
    inv = inverse_scale(torch.tensor(2.0 / 448, device="cuda"))
    h = fp8_gemm_triton(a, w, sa, sb, bias, kernel=kernel, config=config)
    q = fp8_gemm_triton(a, w, sa, sb, bias, inv, kernel=kernel, config=config)
    assert h is not None and q is not None and q.dtype == FP8_DTYPE
    exact = (a.double() @ w.double().t()) * 0.1 * 0.2 + bias.double()
    err = (h.double() - exact).abs().max().item() / exact.abs().max().item()
    print(f"{kernel} {config.name()}: max error {err:.2e} of max |exact|")
    assert err < 1e-2
    unfused = gelu_tanh_quant_triton(h, inv)[1]
    assert torch.equal(q.view(torch.uint8), unfused.view(torch.uint8))
