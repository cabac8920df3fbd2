"""Qwen-Image 2.1 transformer on CUDA (the tiny config of tests/qi21_cases.py, whose widths the Triton
kernels take): a calibrated FP8 model runs its fused Triton producers (no twin is called), fused == unfused
bit for bit over the full pass and the KV-cached steps; the target-only step makes no host syncs and
replays as a CUDA graph with the eager step's bytes."""

import pytest
import torch
from qi21_cases import model_pair
from test_qi21_fp8 import CONFIG, REQUEST, NoDataDependentShapes, quantize, request_inputs, run_steps

import qwen_image_fusion.kernels.scale_modulate as scale_modulate
import qwen_image_fusion.kernels.swiglu_quant as swiglu_quant
from qwen_image_fusion.models.loading import load_transformer
from qwen_image_fusion.models.qwen_image21.loading import build_transformer21
from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    ref, _ = model_pair(CONFIG, torch.bfloat16)
    directory = tmp_path_factory.mktemp("qi21gpu") / "transformer"
    ref.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def fp8_dir(bf16_dir, tmp_path_factory):
    model = load_transformer(bf16_dir, build_transformer21, torch.bfloat16, CUDA)
    return quantize(model, tmp_path_factory.mktemp("qi21gpufp8") / "transformer", QUANTIZATION.all_blocks_fp8)


def forbid_torch_twins(monkeypatch) -> None:
    """Make every 2.1 producer's torch twin fail: a CUDA producer must run its Triton kernel."""

    def no_twin(*_):
        raise AssertionError("a CUDA producer fell back to its torch twin")

    for module, name in (
        (scale_modulate, "layer_norm_scale_torch"),
        (scale_modulate, "tanh_residual_layer_norm_scale_torch"),
        (scale_modulate, "tanh_gated_residual_torch"),
        (swiglu_quant, "silu_mul_torch"),
    ):
        monkeypatch.setattr(module, name, no_twin)


def test_fused_runs_triton_and_equals_unfused(fp8_dir, monkeypatch):
    fused = load_transformer(fp8_dir, build_transformer21, torch.bfloat16, CUDA)
    layers = fused.config.num_layers
    assert fused.fusion_report.summary().splitlines()[:2] == [
        f"FP8 norm+quant fusion: {2 * layers}/{2 * layers} block paths",
        f"FP8 SwiGLU+quant fusion: {layers}/{layers} MLP paths",
    ]
    unfused = load_transformer(fp8_dir, build_transformer21, torch.bfloat16, CUDA)
    unfused.post_load_weights(fuse=False)
    want = run_steps(unfused)

    forbid_torch_twins(monkeypatch)
    got = run_steps(fused)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: {int((a != b).sum())} values differ"


@pytest.mark.parametrize("fuse", [True, False])
def test_target_step_has_no_host_sync_and_replays_as_a_cuda_graph(fp8_dir, fuse):
    model = load_transformer(fp8_dir, build_transformer21, torch.bfloat16, CUDA)
    model.post_load_weights(fuse=fuse)
    layout = model.layout(REQUEST.img_mask(), REQUEST.img_shapes, REQUEST.text_mask())
    cache = model.new_kv_cache(layout, torch.bfloat16)
    latents, text, sigma = request_inputs(model, seed=3)
    static_target = latents[:, -layout.target_len :].clone()
    static_sigma = sigma.clone()
    with torch.no_grad():
        model(latents, text, sigma, layout, cache)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, per-device caches fill
            for _ in range(2):
                model.forward_cached(static_target, static_sigma, layout, cache)
        torch.cuda.current_stream().wait_stream(side)
        with NoDataDependentShapes(CUDA):
            model.forward_cached(static_target, static_sigma, layout, cache)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = model.forward_cached(static_target, static_sigma, layout, cache)
        for seed in (4, 5):
            target, _, new_sigma = request_inputs(model, seed)
            static_target.copy_(target[:, -layout.target_len :])
            static_sigma.copy_(new_sigma)
            graph.replay()
            eager = model.forward_cached(static_target, static_sigma, layout, cache)
            assert torch.equal(static_out, eager), f"seed {seed}"
