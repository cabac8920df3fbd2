"""kernels/fp8_gemm.py: the twin is the model's FP8 GEMM emulation; the Triton candidates (tiled, persistent
with TMA descriptors, persistent warp-specialized) under the CPU interpreter match the twin to the fp32 sum
order, and their GELU + FP8-quant epilogue equals their own bf16 output fed to kernels/gelu_quant.py's
kernel, byte for byte. The compiled kernels (and Hopper's FP8 accumulation) are measured and checked by
bench/fp8_gemm_bench.py and tests/gpu/test_fp8_gemm_gpu.py."""

import numpy as np
import pytest
import torch
from steps import step_distance, subnormal
from test_kernels_quant import interpreter_exact_range, needs_interpreter

from qwen_image_fusion.kernels.fp8_gemm import (
    GemmConfig,
    fp8_gemm_ok,
    fp8_gemm_torch,
    fp8_gemm_triton,
    warp_specialize_available,
)
from qwen_image_fusion.kernels.gelu_quant import (
    gelu_tanh_quant_torch,
    gelu_tanh_quant_triton,
    gelu_tanh_torch,
)
from qwen_image_fusion.kernels.quant import FP8_DTYPE, inverse_scale
from qwen_image_fusion.models.fp8 import scaled_mm

# ragged in every dimension against 32-wide blocks: M and N end mid-tile, K = 80 leaves half a K block
M, N, K = 40, 48, 80
SMALL = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, stages=2, warps=4)
CANDIDATES = [
    ("tiled", SMALL),
    ("persistent", SMALL),
    ("persistent", GemmConfig(32, 32, 32, 2, 2, 4, precise=False)),
    pytest.param(
        "persistent",
        GemmConfig(32, 32, 32, 2, 2, 4, warp_specialize=True),
        marks=pytest.mark.skipif(not warp_specialize_available(), reason="tl.range has no warp_specialize"),
    ),
]


def operands(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).clamp(-8, 8).to(FP8_DTYPE)
    w = torch.randn(N, K, generator=g).clamp(-8, 8).to(FP8_DTYPE)
    bias = (0.1 * torch.randn(N, generator=g)).bfloat16()
    return a, w, torch.tensor([0.1]), torch.tensor([0.2]), bias


def test_twin_is_the_models_fp8_gemm():
    """The twin and models/fp8.py's CPU `scaled_mm` (exact sums, scales, bias, one rounding) agree."""
    a, w, sa, sb, bias = operands()
    for b in (bias, None):
        want = scaled_mm(a, w, sa, sb, b, torch.bfloat16)
        assert torch.equal(fp8_gemm_torch(a, w, sa, sb, b).view(torch.int16), want.view(torch.int16))
    inv = inverse_scale(torch.tensor(0.01))
    q = fp8_gemm_torch(a, w, sa, sb, bias, inv)
    assert q.dtype == FP8_DTYPE
    want_q = gelu_tanh_quant_torch(scaled_mm(a, w, sa, sb, bias, torch.bfloat16), inv)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_guard_rejects_what_the_kernels_cannot_take():
    a, w, sa, sb, bias = operands()
    assert not fp8_gemm_ok(a.float(), w, sa, sb, bias)  # not E4M3
    assert not fp8_gemm_ok(a[:, :72], w[:, :72], sa, sb, bias)  # K % 16 (and a row slice)
    assert not fp8_gemm_ok(a, w, sa.double(), sb, bias)  # scale not fp32
    assert not fp8_gemm_ok(a, w, sa, sb, bias.float())  # bias not bf16
    assert not fp8_gemm_ok(a, w[:32], sa, sb, bias)  # bias length != N


@needs_interpreter
def test_the_tiled_kernel_refuses_warp_specialization():
    a, w, sa, sb, bias = operands()
    with pytest.raises(ValueError, match="warp specialization"):
        fp8_gemm_triton(a, w, sa, sb, bias, config=GemmConfig(warp_specialize=True))


@needs_interpreter
@pytest.mark.parametrize("kernel, config", CANDIDATES)
def test_candidate_matches_twin_and_epilogue_matches_unfused(kernel, config):
    a, w, sa, sb, bias = operands(1)
    inv = inverse_scale(torch.tensor(0.004))
    with np.errstate(over="ignore", invalid="ignore"):
        h = fp8_gemm_triton(a, w, sa, sb, bias, kernel=kernel, config=config)
        q_fused = fp8_gemm_triton(a, w, sa, sb, bias, inv, kernel=kernel, config=config)
        q_unfused = gelu_tanh_quant_triton(h, inv)[1]
    assert h.shape == (M, N) and h.dtype == torch.bfloat16
    # fp32 sums in another order than the twin's exact ones, and the interpreter truncates fp32 -> bf16:
    # within 2 bf16 steps, or within fp32 rounding of the sum where the output cancels to near zero
    want = fp8_gemm_torch(a, w, sa, sb, bias)
    close = (step_distance(h, want) <= 2) | (
        (h.float() - want.float()).abs() <= 1e-5 * want.float().abs().max()
    )
    assert bool(close.all())
    # the contract this project keeps: GEMM + GELU + quant fused == the GEMM's own bf16 -> gelu_quant kernel
    assert q_fused.dtype == FP8_DTYPE
    assert torch.equal(q_fused.view(torch.uint8), q_unfused.view(torch.uint8))
    # and the GELU + quant of that h is the twin's within one fp8 step (the interpreter's conversions and
    # exp-based tanh), away from h < -1 where 1 + tanh cancels (tests/test_kernels_gelu.py bounds that)
    want_q = gelu_tanh_quant_torch(h, inv)
    readable = interpreter_exact_range(gelu_tanh_torch(h), inv, want_q) & ~subnormal(h) & (h.float() > -1)
    assert int(readable.sum()) > M * N // 4
    assert int(step_distance(q_fused, want_q)[readable].max()) <= 1
