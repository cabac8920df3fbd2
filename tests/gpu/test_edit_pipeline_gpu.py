"""GPU (H200) checks of editing through the whole pipeline on an FP8 Edit-2511 checkpoint (`zero_cond_t`,
QwenImageEditPlusPipeline): with the Triton producers every block path fused, fused and unfused edits are
the same PNG bytes, CUDA-graph replays give the eager edits' bytes, and an edit step (target and reference
latents concatenated, per-token modulation rows) has no host sync.

The checkpoint: QWEN_IMAGE_GPU_EDIT_CHECKPOINT when set (the full-size random one of
`bench/make_random_checkpoint.py --edit`: 1024x1024 output, one 1024x1024 reference, as issue 22 §6),
else the tiny diffusers-built Edit-2511 of tests/edit_fixtures.py quantized here on two built-in pairs.
"""

import os

import pytest
import torch
from edit_fixtures import build_edit_checkpoint, drawn_image
from helpers import NoHostSync, png_sha256

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint
from qwen_image_fusion.pipelines.requests import edit_requests_for

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
FULL_SIZE = os.environ.get("QWEN_IMAGE_GPU_EDIT_CHECKPOINT")
SIZE = 1024 if FULL_SIZE else 256  # output side; the reference is drawn at 1024x1024 either way
STEPS = 6


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    if FULL_SIZE:
        return FULL_SIZE
    root = tmp_path_factory.mktemp("edit-gpu")
    bf16 = build_edit_checkpoint(root / "bf16", "QwenImageEditPlusPipeline", True, seed=7)
    requests = edit_requests_for(3)
    return quantize_checkpoint(
        bf16, root / "fp8", [requests[0], requests[-1]], steps=4, size=256, device="cuda"
    )


@pytest.fixture(scope="module")
def pipe(fp8_dir):
    pipe = load_pipeline(fp8_dir, device="cuda")
    assert pipe.variant == "fp8-fused" and pipe.transformer.config.zero_cond_t
    return pipe


def reference() -> list:
    return [drawn_image(1024, 1024, 11)]


def edit(pipe, **changes) -> list[str]:
    args = dict(
        image=reference(), negative_prompt=" ", width=SIZE, height=SIZE, num_inference_steps=STEPS, seed=3
    )
    return [png_sha256(image) for image in pipe.generate("make the sky red", **(args | changes))]


def test_every_path_fused_and_fused_equals_unfused(pipe):
    paths = len(pipe.transformer.fusion_report.block)
    assert paths == 4 * pipe.transformer.config.num_layers
    assert pipe.fusion_summary().splitlines()[0] == f"FP8 norm+quant fusion: {paths}/{paths} block paths"
    fused = edit(pipe, num_images_per_prompt=2)
    pipe.set_variant("fp8-unfused")
    try:
        unfused = edit(pipe, num_images_per_prompt=2)
    finally:
        pipe.set_variant("fp8-fused")
    assert fused == unfused and len(set(fused)) == 2


def test_cuda_graph_replay_equals_eager(pipe):
    assert pipe.cuda_graphs
    graphed = edit(pipe)
    assert pipe._graphed.graphs, "the denoise loop did not go through a captured graph"
    pipe.cuda_graphs = False
    try:
        eager = edit(pipe)
    finally:
        pipe.cuda_graphs = True
    assert graphed == eager


@pytest.mark.parametrize("variant", ["fp8-fused", "fp8-unfused"])
def test_edit_step_has_no_host_sync(pipe, variant):
    pipe.set_variant(variant)
    try:
        model = pipe.model
        canvas = model.canvas(SIZE, SIZE, reference())
        branch = pipe.encode(["make the sky red"], 512, 2, reference())  # two images per prompt
        latents = model.initial_latents(canvas, 2, 0)
        call = model.step_call(latents, torch.full((2,), 0.5, device=CUDA), branch, canvas)
        with torch.no_grad():
            model.run_step(*call.tensors, *call.static)  # warm-up: RoPE tables, autotuning
            with NoHostSync(CUDA):
                velocity = model.run_step(*call.tensors, *call.static)
        assert velocity.shape == latents.shape
    finally:
        pipe.set_variant("fp8-fused")
