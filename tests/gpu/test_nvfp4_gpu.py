"""NVFP4 on CUDA (issue 52; written on a CPU machine, run on the H200): the weight path's compiled GEMM
against its torch twin at the model's shapes (byte for byte where the fp32 sums are exact, within the sums'
rounding elsewhere), the quantizer's bytes the same on CUDA as on the CPU, and an NVFP4 checkpoint through
the pipeline: CUDA graphs give the eager bytes and a step reads nothing back. W4A4: the compiled activation
quantizer is its twin on every bf16 value, the LayerNorm + modulate + NVFP4 producers give the same bytes
fused and unfused at the model's width with codes of their own y, and a GPU without FP4 tensor cores refuses
the W4A4 variants in one line; on capability 10 or later (not the H200: unverified on hardware so far) the
FP4 GEMM against its exact twin and the W4A4 pipeline fused against unfused. The global encode scale's CUDA
cases are tests/test_nvfp4_format.py's (marked gpu)."""

import pytest
import torch
from helpers import png_sha256, step_without_host_sync
from test_kernels_gpu import activations, modulation, noise, safe_rows, same_bytes
from test_kernels_norm_modulate import EPS, explained_by_ln_statistics
from test_kernels_quant import all_bf16

from qwen_image_fusion.kernels.nvfp4 import (
    dequantize_nvfp4,
    nvfp4_linear,
    nvfp4_linear_fp32,
    nvfp4_linear_torch,
    nvfp4_linear_triton,
)
from qwen_image_fusion.kernels.nvfp4_producers import (
    gated_residual_layer_norm_modulate_nvfp4_torch,
    gated_residual_layer_norm_modulate_nvfp4_triton,
    layer_norm_modulate_nvfp4_triton,
)
from qwen_image_fusion.kernels.nvfp4_quant import (
    nvfp4_quant_torch,
    nvfp4_quant_triton,
    unswizzle_block_scales,
)
from qwen_image_fusion.kernels.quant import inverse_scale
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.nvfp4 import (
    W4A4_CAPABILITY,
    Nvfp4Linear,
    nvfp4_scaled_mm,
    quantize_nvfp4_weight,
)
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BF16 = torch.bfloat16
WIDTH = QwenImageConfig().num_attention_heads * QwenImageConfig().attention_head_dim  # 3072
# (N, K) of every quantized linear of a Qwen-Image block: modulation, attention, MLP in and out
SHAPES = [(6 * WIDTH, WIDTH), (WIDTH, WIDTH), (4 * WIDTH, WIDTH), (WIDTH, 4 * WIDTH)]
ROWS = [2, 4096 + 128, 6889]  # the modulation's samples; 1024x1024 with 128 text tokens; 1328x1328


def exact_sum_operands(rows: int, n: int, k: int, seed: int):
    """Operands whose fp32 sums are exact in any order at this K: activations in [-2, 2], block scales
    2^-2..1, so every product is a multiple of 2^-3 at most 12 and K of them stay below 2^24 units."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (rows, k), generator=gen).bfloat16()
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    block_scale = (2.0 ** torch.randint(-2, 1, (n, k // 16), generator=gen)).to(torch.float8_e4m3fn)
    bias = torch.randint(-4, 5, (n,), generator=gen).bfloat16()
    assert k * 12 * 8 < 2**24
    return [t.to(CUDA) for t in (x, packed, block_scale, torch.tensor([0.25]), bias)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_weight_path_kernel_is_its_twin_where_sums_are_exact(rows, n, k):
    args = exact_sum_operands(rows, n, k, seed=rows + n)
    got = nvfp4_linear_triton(*args)
    assert got is not None
    assert torch.equal(got.view(torch.int16), nvfp4_linear_torch(*args).view(torch.int16))
    assert torch.equal(nvfp4_linear(*args).view(torch.int16), got.view(torch.int16))  # CUDA runs Triton


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_weight_path_kernel_within_the_fp32_sums_rounding_on_random_data(rows, n, k):
    gen = torch.Generator(device=CUDA).manual_seed(rows + k)
    x = torch.randn(rows, k, generator=gen, device=CUDA).bfloat16()
    packed, block_scale, weight_scale_2 = quantize_nvfp4_weight(torch.randn(n, k, generator=gen, device=CUDA))
    bias = torch.randn(n, generator=gen, device=CUDA).bfloat16()
    args = (x, packed, block_scale, weight_scale_2.reshape(1), bias)
    got = nvfp4_linear_triton(*args).float()
    twin = nvfp4_linear_fp32(*args)
    # two orders of K fp32 additions differ by at most 2 K u sum|x w| (u = 2^-24), then one bf16 rounding
    magnitude = (x.float().abs() @ dequantize_nvfp4(packed, block_scale).float().abs().t()) * weight_scale_2
    bound = 2 * k * 2.0**-24 * magnitude + 2.0**-8 * twin.abs()
    excess = (got - twin).abs() - bound
    print(f"rows {rows} N {n} K {k}: max |kernel - twin| {float((got - twin).abs().max()):.3g}")
    assert float(excess.max()) <= 0


def test_quantizer_gives_the_cpus_bytes_on_cuda():
    weight = torch.randn(3072, 3072, generator=torch.Generator().manual_seed(0)) * 0.02
    on_cpu, on_cuda = quantize_nvfp4_weight(weight), quantize_nvfp4_weight(weight.to(CUDA))
    for cpu, cuda in zip(on_cpu, on_cuda, strict=True):
        assert torch.equal(cpu.reshape(-1).view(torch.uint8), cuda.cpu().reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("nvfp4gpu") / "model"
    prompts = ["a red fox", "一只熊猫"]
    return quantize_checkpoint(None, out, prompts, steps=4, size=128, device="cuda", weights="nvfp4")


def test_nvfp4_pipeline_graphs_equal_eager_and_read_nothing_back(nvfp4_dir):
    pipe = load_pipeline(nvfp4_dir, device="cuda")
    assert pipe.variant == "nvfp4"
    assert any(isinstance(m, Nvfp4Linear) for m in pipe.transformer.modules())
    args = dict(negative_prompt="blurry", width=192, height=128, num_inference_steps=5, seed=4)
    graphed = [png_sha256(im) for im in pipe.generate(["a red fox", "a castle"], **args)]
    assert pipe._graphed.graphs, "the denoise loop did not go through a captured graph"
    pipe.cuda_graphs = False
    assert [png_sha256(im) for im in pipe.generate(["a red fox", "a castle"], **args)] == graphed
    step_without_host_sync(pipe.transformer, (1, 8, 8), CUDA, text_tokens=7, pad_from=5)


# W4A4: the activation quantizer and the producers run on every CUDA GPU; the FP4 GEMM on capability >= 10.


@pytest.mark.parametrize("encode", [1.0, 2.0**-5, 3.7, 37.5, 448.0, 1e30, 1e-30])
def test_quantizer_kernel_is_its_twin_on_every_bf16_value(encode):
    y = all_bf16().reshape(64, 1024).to(CUDA)
    g = torch.tensor([encode], device=CUDA)
    q, s = nvfp4_quant_triton(y, g)
    q_ref, s_ref = nvfp4_quant_torch(y, g)
    assert torch.equal(q, q_ref) and same_bytes(s, s_ref)
    q_cpu, s_cpu = nvfp4_quant_torch(y.cpu(), g.cpu())  # the twin's bytes are the CPU's
    assert torch.equal(q.cpu(), q_cpu) and same_bytes(s.cpu(), s_cpu)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("rows", [4224, 6889 + 1])
def test_w4a4_producers_fused_equal_unfused_and_quantize_their_own_y(rows, per_token):
    x = activations(rows, WIDTH, seed=rows)
    residual = noise(x, seed=rows + 1)
    batch, seq, _ = x.shape
    index = None
    if per_token:  # Edit-2511: the reference half of each sample's tokens on the t = 0 rows
        gate, shift, scale = modulation(2 * batch, WIDTH, seed=rows + 2)
        later = (torch.arange(seq, device=CUDA) >= seq // 2).to(torch.int32)
        index = torch.arange(batch, dtype=torch.int32, device=CUDA)[:, None] + batch * later
    else:
        gate, shift, scale = modulation(batch, WIDTH, seed=rows + 2)
    g = torch.tensor([20.0], device=CUDA)
    y1, _, _ = layer_norm_modulate_nvfp4_triton(x, shift, scale, EPS, None, True, False, index)
    y1_fused, q1, s1 = layer_norm_modulate_nvfp4_triton(x, shift, scale, EPS, g, True, True, index)
    _, q1_only, s1_only = layer_norm_modulate_nvfp4_triton(x, shift, scale, EPS, g, False, True, index)
    q1_unfused, s1_unfused = nvfp4_quant_triton(y1, g)
    assert same_bytes(y1_fused, y1) and torch.equal(q1, q1_unfused) and torch.equal(q1_only, q1)
    assert same_bytes(s1, s1_unfused) and same_bytes(s1_only, s1)
    q1_ref, s1_ref = nvfp4_quant_torch(y1, g)
    assert torch.equal(q1, q1_ref) and same_bytes(s1, s1_ref)
    assert bool(
        explained_by_ln_statistics(y1, x, shift, scale, False, index)[safe_rows(x).expand_as(x)].all()
    )

    args = (residual, gate, x, shift, scale, EPS)
    r, y2, _, _ = gated_residual_layer_norm_modulate_nvfp4_triton(*args, None, True, False, index)
    r_fused, y2_fused, q2, s2 = gated_residual_layer_norm_modulate_nvfp4_triton(*args, g, True, True, index)
    q2_unfused, s2_unfused = nvfp4_quant_triton(y2, g)
    assert same_bytes(r_fused, r) and same_bytes(y2_fused, y2)
    assert torch.equal(q2, q2_unfused) and same_bytes(s2, s2_unfused)
    r_ref, _, _, _ = gated_residual_layer_norm_modulate_nvfp4_torch(*args, g, False, False, index)
    assert same_bytes(r, r_ref)


BLACKWELL = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < W4A4_CAPABILITY,
    reason="the FP4 GEMM needs CUDA capability 10.0 or later (Blackwell)",
)


def test_w4a4_is_refused_in_one_line_without_fp4_tensor_cores(nvfp4_dir):
    if torch.cuda.get_device_capability() >= W4A4_CAPABILITY:
        pytest.skip("this GPU has FP4 tensor cores")
    pipe = load_pipeline(nvfp4_dir, device="cuda")
    with pytest.raises(InputError, match="has no FP4 tensor cores") as refused:
        pipe.set_variant("nvfp4-w4a4-fused")
    assert len(str(refused.value).splitlines()) == 1 and pipe.variant == "nvfp4"


@BLACKWELL
@pytest.mark.parametrize("n, k", SHAPES)
def test_fp4_gemm_against_its_exact_twin(n, k):
    """Unverified on hardware until this runs on a Blackwell GPU: `torch._scaled_mm`'s NVFP4 recipe against
    the exact dot (computed on the CPU), within the rounding of K fp32 additions in the tensor cores."""
    gen = torch.Generator(device=CUDA).manual_seed(n + k)
    x = torch.randn(256, k, generator=gen, device=CUDA).bfloat16()  # the twin's int64 dot runs on the CPU
    packed_w, scale_w, weight_scale_2 = quantize_nvfp4_weight(torch.randn(n, k, generator=gen, device=CUDA))
    input_scale = torch.tensor(0.05, device=CUDA)
    packed_a, swizzled_a = nvfp4_quant_triton(x, inverse_scale(input_scale))
    alpha = input_scale * weight_scale_2
    got = nvfp4_scaled_mm(
        packed_a, swizzled_a, input_scale, packed_w, scale_w, weight_scale_2, alpha, None, BF16
    )
    cpu = [t.cpu() for t in (packed_a, swizzled_a, input_scale, packed_w, scale_w, weight_scale_2, alpha)]
    twin = nvfp4_scaled_mm(*cpu, None, torch.float32)
    rows = packed_a.shape[0]
    a = dequantize_nvfp4(packed_a, unswizzle_block_scales(swizzled_a, rows, k // 16)).float().abs()
    magnitude = (a @ dequantize_nvfp4(packed_w, scale_w).float().abs().t()).cpu() * alpha.cpu()
    bound = 2 * k * 2.0**-24 * magnitude + 2.0**-8 * twin.abs()
    assert float(((got.float().cpu() - twin).abs() - bound).max()) <= 0


@BLACKWELL
def test_w4a4_pipeline_fused_equals_unfused_with_graphs(nvfp4_dir):
    pipe = load_pipeline(nvfp4_dir, variant="nvfp4-w4a4-fused", device="cuda")
    layers = pipe.transformer.config.num_layers
    assert pipe.fusion_summary().startswith(f"NVFP4 norm+quant fusion: {4 * (layers - 4)}/{4 * layers}")
    args = dict(negative_prompt=" ", width=256, height=192, num_inference_steps=10, seed=3)
    prompts = ["a red fox in the snow", "a neon street at night"]
    fused = [png_sha256(im) for im in pipe.generate(prompts, **args)]
    assert pipe._graphed.graphs
    pipe.set_variant("nvfp4-w4a4-unfused")
    assert [png_sha256(im) for im in pipe.generate(prompts, **args)] == fused
    step_without_host_sync(pipe.transformer, (1, 8, 8), CUDA, text_tokens=7, pad_from=5)
