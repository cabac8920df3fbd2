"""Qwen-Image 2.1 through the whole pipeline on the H200 (the tiny checkpoint of tests/qi21_checkpoints.py,
whose widths the Triton kernels take), quantized on CUDA with every block linear in FP8:

- fp8-fused runs the Triton producers (no torch twin is called) and gives the PNG bytes of fp8-unfused, with a
  condition image, true CFG and a padded prompt batch, the KV cache on and off;
- CUDA-graph replay gives the eager PNGs; the target step's graph is captured once and replayed for the next
  request of the same shape (no new capture), and the uncached full pass replays too;
- the target step makes no host sync on CUDA;
- cached and uncached images are close but need not be equal (the target step's GEMMs see other row counts,
  as diffusers notes for its cache);
- reference mode equals diffusers' `QwenImage21Pipeline` on CUDA, PNG for PNG, cache on and off.
"""

import numpy as np
import pytest
import torch
from edit_fixtures import drawn_image
from helpers import NoHostSync, png_sha256
from qi21_checkpoints import RESOLUTION, build_qi21_checkpoint, diffusers_pipeline
from test_qi21_model_gpu import forbid_torch_twins

from qwen_image_fusion.eval.metrics import psnr
from qwen_image_fusion.models.qwen_image21 import steps
from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
LAYERS = 2
IMAGE = drawn_image(160, 96, seed=3, mode="RGBA")
REQUESTS = {
    "condition image, true CFG": dict(
        prompt="make it snow", image=IMAGE, negative_prompt="blurry", true_cfg_scale=3.0
    ),
    "padded prompt batch": dict(prompt=["a red fox", "a longer prompt about a red fox"], width=96, height=64),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qi21gpu")
    bf16 = build_qi21_checkpoint(root / "bf16")
    prompts = ["a red fox", "一只熊猫"]
    every_block = QUANTIZATION.all_blocks_fp8
    fp8 = quantize_checkpoint(bf16, root / "fp8", prompts, every_block, steps=3, size=64, device="cuda")
    return {"bf16": bf16, "fp8": fp8}


@pytest.fixture(scope="module")
def pipe(checkpoints):
    pipe = load_pipeline(checkpoints["fp8"], device="cuda")
    pipe.model.resolution = RESOLUTION
    return pipe


def run(pipe, request: str, cache: bool = True, seed: int = 4) -> list[str]:
    pipe.model.use_kv_cache = cache
    return [png_sha256(im) for im in pipe.generate(num_inference_steps=4, seed=seed, **REQUESTS[request])]


def test_fused_runs_triton_and_equals_unfused(pipe, monkeypatch):
    assert pipe.fusion_summary().splitlines()[:2] == [
        f"FP8 norm+quant fusion: {2 * LAYERS}/{2 * LAYERS} block paths",
        f"FP8 SwiGLU+quant fusion: {LAYERS}/{LAYERS} MLP paths",
    ]
    forbid_torch_twins(monkeypatch)
    fused = {(r, c): run(pipe, r, c) for r in REQUESTS for c in (True, False)}
    pipe.set_variant("fp8-unfused")
    try:
        unfused = {(r, c): run(pipe, r, c) for r in REQUESTS for c in (True, False)}
    finally:
        pipe.set_variant("fp8-fused")
    assert fused == unfused
    assert len({h for hashes in fused.values() for h in hashes}) > len(REQUESTS)


def test_graph_replay_equals_eager_and_is_reused_across_requests(pipe):
    assert pipe.cuda_graphs
    pipe._graphed.graphs.clear()
    graphed = run(pipe, "condition image, true CFG")
    captured = dict(pipe._graphed.graphs)
    slots = [key for key in captured if isinstance(key[0][0], steps.CacheSlot)]
    assert len(slots) == 2, "one target-step graph per CFG branch"
    again = run(pipe, "condition image, true CFG", seed=5)  # a new request of the same shape
    assert dict(pipe._graphed.graphs) == captured, "the next request replays the captured graphs"
    uncached = run(pipe, "condition image, true CFG", cache=False)
    pipe.cuda_graphs = False
    try:
        assert run(pipe, "condition image, true CFG") == graphed
        assert run(pipe, "condition image, true CFG", seed=5) == again
        assert run(pipe, "condition image, true CFG", cache=False) == uncached
    finally:
        pipe.cuda_graphs = True


def test_target_step_has_no_host_sync_on_cuda(pipe, monkeypatch):
    run_slot = steps.CacheSlot.run
    guarded = []

    def run_guarded(self, *args):
        with NoHostSync(CUDA):
            guarded.append(run_slot(self, *args))
        return guarded[-1]

    monkeypatch.setattr(steps.CacheSlot, "run", run_guarded)
    pipe.cuda_graphs = False
    try:
        run(pipe, "padded prompt batch")
    finally:
        pipe.cuda_graphs = True
    assert len(guarded) == 3


def test_cached_and_uncached_images_are_close(pipe):
    pipe.model.use_kv_cache = True
    args = dict(num_inference_steps=4, seed=4, **REQUESTS["condition image, true CFG"])
    cached = np.asarray(pipe.generate(**args)[0].convert("RGB"))
    pipe.model.use_kv_cache = False
    uncached = np.asarray(pipe.generate(**args)[0].convert("RGB"))
    pipe.model.use_kv_cache = True
    quality = psnr(cached, uncached)
    worst = np.abs(cached.astype(int) - uncached).max()
    print(f"cached vs uncached: PSNR {quality:.1f} dB, max |diff| {worst}")
    assert quality >= 30.0


@pytest.mark.parametrize("cache", [True, False])
def test_reference_mode_matches_diffusers_on_cuda(checkpoints, cache):
    ours = load_pipeline(checkpoints["bf16"], variant="reference", device="cuda")
    ours.model.resolution = RESOLUTION
    ours.model.use_kv_cache = cache
    theirs = diffusers_pipeline(checkpoints["bf16"], torch.bfloat16).to("cuda")
    for request in REQUESTS.values():
        got = ours.generate(num_inference_steps=3, seed=6, **request)
        generator = torch.Generator("cpu").manual_seed(6)
        want = theirs(num_inference_steps=3, generator=generator, use_kv_cache=cache,
                      output_resolution=RESOLUTION, **request).images  # fmt: skip
        assert [png_sha256(im) for im in got] == [png_sha256(im) for im in want]
