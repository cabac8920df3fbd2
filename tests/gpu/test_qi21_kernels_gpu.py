"""Compiled Qwen-Image 2.1 producer kernels on CUDA against the torch twins and against themselves
(DESIGN §4.1), at the released model's widths (from `QwenImage21Config()`):

- producers (a) and (b) at rows {1, 127, 1024, 4096} x width {D, 3D/4} x 3 input scales, activations
  holding every bf16 encoding plus normal data, modulation rows read per token (a t = 0 prefix row):
  fused == unfused byte for byte and from the same compiled binary; r equal to the twin's; y explained by
  the LN statistics within the sum-order slack and differing from the twin in at most 1e-4 of the values;
  q == the quantizer of the kernel's own y, byte-exact;
- the same with every bf16 encoding as scale rows and as gate rows;
- the tanh rows: the same fp32 bits on CUDA and on the CPU for every bf16 gate;
- SwiGLU at rows {1, 127, 1024, 4096} x hidden {3D, D} x 3 scales, g (then p) holding every bf16 encoding:
  fused == unfused from one binary; y within the exp slack of the contract everywhere; q == quant(y).
Mismatch counts vs the twins are printed (run with -s).
"""

import pytest
import torch
from steps import step_distance
from test_kernels_gpu import activations, binaries, noise, report, safe_rows, same_bytes
from test_kernels_norm_modulate import EPS
from test_kernels_quant import all_bf16
from test_qi21_kernels import explained_scale_only, within_exp_slack

import qwen_image_fusion.kernels.scale_modulate as scale_modulate
import qwen_image_fusion.kernels.swiglu_quant as swiglu_quant
from qwen_image_fusion.kernels.quant import inverse_scale, static_quant_fp8_torch, static_quant_fp8_triton
from qwen_image_fusion.kernels.scale_modulate import (
    _layer_norm_scale_kernel,
    _tanh_residual_layer_norm_scale_kernel,
    layer_norm_scale,
    layer_norm_scale_torch,
    layer_norm_scale_triton,
    tanh_gated_residual_triton,
    tanh_residual_layer_norm_scale,
    tanh_residual_layer_norm_scale_torch,
    tanh_residual_layer_norm_scale_triton,
    tanh_rows,
)
from qwen_image_fusion.kernels.swiglu_quant import (
    _silu_mul_quant_kernel,
    silu_mul,
    silu_mul_quant_triton,
    silu_mul_triton,
)
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config

pytestmark = pytest.mark.gpu
CONFIG = QwenImage21Config()
ROWS = [1, 127, 1024, 4096]
WIDTHS = [CONFIG.inner_dim, CONFIG.inner_dim * 3 // 4]  # the model's, and one with a masked block tail
HIDDEN = [CONFIG.mlp_dim, CONFIG.inner_dim]
SCALES = [0.02, 0.4263392984867096, 3.7]
CASES = [(rows, width) for rows in ROWS for width in WIDTHS]


def modulation21(batch: int, tokens: int, width: int, seed: int):
    """(scale, gate) as strided chunks of one bf16 [B + 1, 4D] tensor (2.1's shared projection, with the
    t = 0 row last), and the int32 [B, L] rows: the first third of the tokens read row B."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    mod = (0.5 * torch.randn(batch + 1, 4 * width, device="cuda", generator=g)).bfloat16()
    index = torch.arange(batch, dtype=torch.int32, device="cuda").view(batch, 1).repeat(1, tokens)
    index[:, : tokens // 3] = batch
    return mod[:, :width], mod[:, width : 2 * width], index


def check_y_and_q(tag, ln_input, y, q, y_twin, q_twin, scale, index, inv) -> None:
    """y against the twin's: at most 1e-4 of the values differ, each explained by the LN statistics in the
    overflow-safe rows; q is the quantizer of the kernel's own y, byte-exact."""
    ok = safe_rows(ln_input)
    bad = report(f"{tag} y", y, y_twin, ok)
    report(f"{tag} q", q, q_twin, ok)
    assert bad <= max(8, y_twin.numel() // 10_000)
    explained = explained_scale_only(y, ln_input, scale, index, interpreter=False)
    assert bool(explained[ok.expand_as(y)].all())
    assert same_bytes(q, static_quant_fp8_torch(y, inv))


@pytest.mark.parametrize("rows, width", CASES)
def test_layer_norm_scale(rows, width):
    x = activations(rows, width, seed=rows + width)
    scale, _, index = modulation21(x.shape[0], x.shape[1], width, seed=rows)
    args = (x, scale, index, EPS)
    for s in SCALES:
        inv = inverse_scale(torch.tensor(s, device="cuda"))
        y_unfused, _ = layer_norm_scale_triton(*args)
        q_unfused = static_quant_fp8_triton(y_unfused, inv)
        compiled = binaries(_layer_norm_scale_kernel)
        y_fused, q_fused = layer_norm_scale_triton(*args, inv)
        _, q_only = layer_norm_scale_triton(*args, inv, write_y=False)
        assert binaries(_layer_norm_scale_kernel) == compiled  # the fused launches reused the binary
        assert same_bytes(y_fused, y_unfused)
        assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)
        y_ref, q_ref = layer_norm_scale_torch(*args, inv)
        tag = f"(a) rows={rows} D={width} s={s}"
        check_y_and_q(tag, x, y_fused, q_fused, y_ref, q_ref, scale, index, inv)


def check_producer_b(tag, residual, tanh_gate, x, scale, index, inv) -> None:
    args = (residual, tanh_gate, x, scale, index, EPS)
    kernel = _tanh_residual_layer_norm_scale_kernel
    r_unfused, y_unfused, _ = tanh_residual_layer_norm_scale_triton(*args)
    q_unfused = static_quant_fp8_triton(y_unfused, inv)
    compiled = binaries(kernel)
    r_fused, y_fused, q_fused = tanh_residual_layer_norm_scale_triton(*args, inv)
    r_only, _, q_only = tanh_residual_layer_norm_scale_triton(*args, inv, write_y=False)
    residual_only = tanh_gated_residual_triton(residual, tanh_gate, x, index)
    assert binaries(kernel) == compiled
    for r in (r_fused, r_only, residual_only):
        assert same_bytes(r, r_unfused)
    assert same_bytes(y_fused, y_unfused)
    assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)
    r_ref, y_ref, q_ref = tanh_residual_layer_norm_scale_torch(*args, inv)
    assert int(step_distance(r_fused, r_ref).max()) == 0  # no reduction: equal values, NaN where NaN
    check_y_and_q(tag, r_fused, y_fused, q_fused, y_ref, q_ref, scale, index, inv)


@pytest.mark.parametrize("rows, width", CASES)
def test_tanh_residual_layer_norm_scale(rows, width):
    residual = activations(rows, width, seed=rows + width)
    x = noise(residual, seed=rows + width + 1000)
    scale, gate, index = modulation21(x.shape[0], x.shape[1], width, seed=rows + 1)
    for s in SCALES:
        inv = inverse_scale(torch.tensor(s, device="cuda"))
        check_producer_b(f"(b) rows={rows} D={width} s={s}", residual, tanh_rows(gate), x, scale, index, inv)


def test_every_encoding_as_scale_and_gate_rows():
    """16 rows x 4096 hold all 65536 bf16 encodings, once as scale rows and once (shuffled) as gate rows;
    4096 tokens read them round robin. Byte-exactness as above; y compared with the twin by count only
    (inf / NaN scales make whole rows non-finite)."""
    width = CONFIG.inner_dim
    every = all_bf16().cuda().reshape(-1, width)
    gate = every[torch.randperm(every.shape[0], device="cuda")].flip(1).contiguous()
    residual = activations(4096, width, seed=31)
    x = noise(residual, seed=1031)
    batch, tokens = x.shape[:2]
    index = (torch.arange(batch * tokens, device="cuda") % every.shape[0]).view(batch, tokens).int()
    inv = inverse_scale(torch.tensor(0.05, device="cuda"))
    args = (residual, tanh_rows(gate), x, every, index, EPS)
    r_unfused, y_unfused, _ = tanh_residual_layer_norm_scale_triton(*args)
    r_fused, y_fused, q_fused = tanh_residual_layer_norm_scale_triton(*args, inv)
    assert same_bytes(r_fused, r_unfused) and same_bytes(y_fused, y_unfused)
    assert same_bytes(q_fused, static_quant_fp8_triton(y_unfused, inv))
    r_ref, y_ref, _ = tanh_residual_layer_norm_scale_torch(*args, inv)
    assert int(step_distance(r_fused, r_ref).max()) == 0
    everywhere = torch.ones(batch, tokens, 1, dtype=torch.bool, device="cuda")
    assert report("every encoding y", y_fused, y_ref, everywhere) <= y_ref.numel() // 10_000
    assert same_bytes(q_fused, static_quant_fp8_torch(y_fused, inv))
    y_a, _ = layer_norm_scale_triton(x, every, index, EPS)
    _, q_a = layer_norm_scale_triton(x, every, index, EPS, inv)
    assert same_bytes(q_a, static_quant_fp8_triton(y_a, inv))


def test_tanh_rows_are_the_same_on_cuda_and_cpu():
    gate = all_bf16().reshape(16, -1)
    cpu, cuda = tanh_rows(gate), tanh_rows(gate.cuda()).cpu()
    assert torch.equal(cpu.isnan(), cuda.isnan())
    ok = ~cpu.isnan()
    differ = int((cpu[ok].view(torch.int32) != cuda[ok].view(torch.int32)).sum())
    assert differ == 0, f"{differ} of {int(ok.sum())} fp32 tanh values differ between CUDA and CPU"


@pytest.mark.parametrize("rows, hidden", [(rows, hidden) for rows in ROWS for hidden in HIDDEN])
def test_silu_mul(rows, hidden):
    every_g = activations(rows, hidden, seed=rows * hidden)
    other = noise(every_g, seed=rows * hidden + 1000)
    for g, p in ((every_g, other), (other, every_g)):
        y_unfused = silu_mul_triton(g, p)
        compiled = binaries(_silu_mul_quant_kernel)
        for s in SCALES:
            inv = inverse_scale(torch.tensor(s, device="cuda"))
            q_unfused = static_quant_fp8_triton(y_unfused, inv)
            y_fused, q_fused = silu_mul_quant_triton(g, p, inv, write_y=True)
            _, q_only = silu_mul_quant_triton(g, p, inv)
            assert same_bytes(y_fused, y_unfused)
            assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)
            assert same_bytes(q_fused, static_quant_fp8_torch(y_fused, inv))
        assert binaries(_silu_mul_quant_kernel) == compiled
        everywhere = torch.ones(*g.shape[:2], 1, dtype=torch.bool, device="cuda")
        report(f"swiglu rows={rows} H={hidden} y", y_unfused, swiglu_quant.silu_mul_torch(g, p), everywhere)
        assert bool(within_exp_slack(y_unfused, g, p, tol=0).all())


def test_dispatch_on_cuda_uses_triton(monkeypatch):
    def no_twin(*_):
        raise AssertionError("CUDA input the guard accepts must not fall back to the torch twin")

    for module, name in (
        (scale_modulate, "layer_norm_scale_torch"),
        (scale_modulate, "tanh_residual_layer_norm_scale_torch"),
        (swiglu_quant, "silu_mul_torch"),
    ):
        monkeypatch.setattr(module, name, no_twin)
    x = activations(8, CONFIG.inner_dim, seed=1)
    scale, gate, index = modulation21(x.shape[0], x.shape[1], CONFIG.inner_dim, seed=2)
    inv = inverse_scale(torch.tensor(0.02, device="cuda"))
    args = (x, tanh_rows(gate), x, scale, index, EPS, inv)
    pairs = [
        (layer_norm_scale(x, scale, index, EPS, inv), layer_norm_scale_triton(x, scale, index, EPS, inv)),
        (tanh_residual_layer_norm_scale(*args), tanh_residual_layer_norm_scale_triton(*args)),
        ((silu_mul(x, x),), (silu_mul_triton(x, x),)),
    ]
    for got, want in pairs:
        assert all(same_bytes(a, b) for a, b in zip(got, want, strict=True))
