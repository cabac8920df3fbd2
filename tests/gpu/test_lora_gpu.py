"""GPU (H200) checks of LoRA on FP8: with the Triton producers, fused == unfused byte for byte in branch mode
(dual output) and in merge mode, CUDA-graph replays equal eager steps with a LoRA branch, no host syncs.

With QWEN_IMAGE_GPU_CHECKPOINT set to a full-size FP8 checkpoint (bench/make_random_checkpoint.py writes
one), the same byte identity at 1024x1024 with a rank-64 LoRA on every block linear.
"""

import os

import pytest
import torch
from helpers import png_sha256, step_without_host_sync
from lora_files import block_modules, linear_shapes, random_factors, write_lightning

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.lora import fp8_input_clipping
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
FULL_SIZE = os.environ.get("QWEN_IMAGE_GPU_CHECKPOINT")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8lora") / "model"
    return quantize_checkpoint(None, out, prompts=["a red fox", "一只熊猫"], steps=4, size=128, device="cuda")


def _lightning_file(pipe, path, rank: int, std: float):
    """A Lightning-layout LoRA (bf16, alpha rank/8 as the public files) on every block linear."""
    shapes, layers = linear_shapes(pipe.transformer), pipe.transformer.config.num_layers
    factors = random_factors(shapes, block_modules(layers), rank, seed=5, std=std, dtype=torch.bfloat16)
    return write_lightning(path, factors, rank / 8)


def _fused_vs_unfused(pipe, prompts, **args) -> tuple[list[str], list[str]]:
    pipe.set_variant("fp8-fused")
    fused = [png_sha256(image) for image in pipe.generate(prompts, **args)]
    pipe.set_variant("fp8-unfused")
    unfused = [png_sha256(image) for image in pipe.generate(prompts, **args)]
    return fused, unfused


def test_branch_and_merge_fused_equal_unfused_on_gpu(fp8_dir, tmp_path):
    pipe = load_pipeline(fp8_dir, device="cuda")
    prompts = ["a red fox in the snow", "a neon street at night", "一只熊猫在竹林里"]
    args = dict(negative_prompt=" ", width=256, height=192, num_inference_steps=8, seed=3)
    base = [png_sha256(image) for image in pipe.generate(prompts, **args)]
    pipe.load_lora(_lightning_file(pipe, tmp_path / "lightning.safetensors", 16, 0.2), scale=0.8)
    paths = 4 * pipe.transformer.config.num_layers  # the producer paths of the blocks
    assert f"fused ({paths}): dual output (LoRA branch needs y)" in pipe.fusion_summary()
    fused, unfused = _fused_vs_unfused(pipe, prompts, **args)
    assert fused == unfused and fused != base and len(set(fused)) == len(prompts)
    pipe.set_lora_mode("merge")
    merged, merged_unfused = _fused_vs_unfused(pipe, prompts, **args)
    assert merged == merged_unfused and merged != fused
    pipe.unload_lora()
    pipe.set_variant("fp8-fused")
    assert [png_sha256(image) for image in pipe.generate(prompts, **args)] == base


def test_cuda_graph_replay_with_a_lora_branch_matches_eager(fp8_dir, tmp_path):
    pipe = load_pipeline(fp8_dir, device="cuda")
    pipe.load_lora(_lightning_file(pipe, tmp_path / "lightning.safetensors", 16, 0.2))
    args = dict(negative_prompt="blurry", width=192, height=128, num_inference_steps=5, seed=4)
    graphed = [png_sha256(im) for im in pipe.generate(["a red fox", "a castle"], **args)]
    assert pipe._graphed.graphs
    pipe.set_lora_scales({"lightning": 1.0})
    assert pipe._graphed.graphs, "the same scale again (as the UI sends each run) keeps the graphs"
    pipe.set_lora_scales({"lightning": 0.5})
    assert not pipe._graphed.graphs, "a scale change must drop the captured graphs"
    rescaled = [png_sha256(im) for im in pipe.generate(["a red fox", "a castle"], **args)]
    pipe.cuda_graphs = False
    assert [png_sha256(im) for im in pipe.generate(["a red fox", "a castle"], **args)] == rescaled
    assert rescaled != graphed


@pytest.mark.parametrize("variant", ["fp8-fused", "fp8-unfused"])
def test_lora_branch_step_has_no_host_sync_on_gpu(fp8_dir, tmp_path, variant):
    pipe = load_pipeline(fp8_dir, variant=variant, device="cuda")
    pipe.load_lora(_lightning_file(pipe, tmp_path / "lightning.safetensors", 16, 0.2))
    step_without_host_sync(pipe.transformer, (1, 8, 8), CUDA, text_tokens=7, pad_from=None)


@pytest.mark.skipif(FULL_SIZE is None, reason="set QWEN_IMAGE_GPU_CHECKPOINT to a full-size FP8 checkpoint")
def test_full_size_lora_fused_equals_unfused_in_both_modes(tmp_path):
    pipe = load_pipeline(FULL_SIZE, device="cuda")
    pipe.load_lora(_lightning_file(pipe, tmp_path / "lightning-r64.safetensors", 64, 0.03))
    layers = pipe.transformer.config.num_layers
    assert f"fused ({4 * layers}): dual output (LoRA branch needs y)" in pipe.fusion_summary()
    args = dict(negative_prompt=" ", width=1024, height=1024, seed=0, preset="lightning-8")
    prompts = ["a red fox in the snow, detailed fur", "a neon street at night"]
    fused, unfused = _fused_vs_unfused(pipe, prompts, **args)
    assert fused == unfused and len(set(fused)) == len(prompts)
    pipe.set_lora_mode("merge")
    print(pipe.lora_merge.summary())
    merged, merged_unfused = _fused_vs_unfused(pipe, prompts, **args)
    assert merged == merged_unfused and merged != fused
    print(fp8_input_clipping(pipe, prompts[0], **args).summary())
