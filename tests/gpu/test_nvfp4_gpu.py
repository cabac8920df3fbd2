"""NVFP4 on CUDA (issue 52; written on a CPU machine, run on the H200): the weight path's compiled GEMM
against its torch twin at the model's shapes (byte for byte where the fp32 sums are exact, within the sums'
rounding elsewhere), the quantizer's bytes the same on CUDA as on the CPU, and an NVFP4 checkpoint through
the pipeline: CUDA graphs give the eager bytes and a step reads nothing back. The global encode scale's
CUDA cases are tests/test_nvfp4_format.py's (marked gpu)."""

import pytest
import torch
from helpers import png_sha256, step_without_host_sync

from qwen_image_fusion.kernels.nvfp4 import (
    dequantize_nvfp4,
    nvfp4_linear,
    nvfp4_linear_fp32,
    nvfp4_linear_torch,
    nvfp4_linear_triton,
)
from qwen_image_fusion.models.nvfp4 import Nvfp4Linear, quantize_nvfp4_weight
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
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
