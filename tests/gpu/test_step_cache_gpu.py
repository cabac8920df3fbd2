"""GPU (H200) checks of the step cache inside the CUDA-graph step: the graphed run (both ways of each
decision captured, one replayed per call) gives the eager run's bytes and skips the same steps, fused and
unfused FP8 stay byte-identical with a cache, and caching off is still the exact graphed path; under
placements that stream or lend transformer blocks (graph cut at each decision, skipped blocks' copies
left out) a cached run gives the resident pipeline's bytes, graphed and eager."""

import math

import pytest
import torch
from helpers import png_sha256
from memory_fixtures import placed_pipeline

from qwen_image_fusion.models.cache_presets import CACHE_PRESETS, CachePreset
from qwen_image_fusion.models.streaming import CudaLink
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.precision import Precision
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu
ALWAYS = CachePreset("always", threshold=math.inf, warmup_steps=2, max_cached_in_a_row=2)
ALWAYS_BACK = CachePreset(
    "always-back", threshold=math.inf, back_blocks=1, warmup_steps=2, max_cached_in_a_row=2
)
GPU = Precision(torch.bfloat16, torch.bfloat16, "what load_pipeline picks on CUDA")
ARGS = dict(negative_prompt="blurry", width=192, height=128, num_inference_steps=12, seed=4)
PROMPTS = ["a red fox", "a castle"]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8cache") / "model"
    return quantize_checkpoint(None, out, prompts=["a red fox", "一只熊猫"], steps=4, size=128, device="cuda")


@pytest.mark.parametrize("preset", [ALWAYS, CACHE_PRESETS["faster"]], ids=lambda p: p.name)
def test_graphed_cache_equals_eager_and_fused_equals_unfused(fp8_dir, preset):
    pipe = load_pipeline(fp8_dir, device="cuda")
    assert pipe.cuda_graphs and pipe.variant == "fp8-fused"
    exact = [png_sha256(im) for im in pipe.generate(PROMPTS, **ARGS)]
    runs = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        for graphs in (True, False):
            pipe.cuda_graphs = graphs
            images = pipe.generate(PROMPTS, **ARGS, cache=preset)
            runs[variant, graphs] = ([png_sha256(im) for im in images], pipe.last_run.cache)
            if graphs:
                keys = [key for key in pipe._graphed.graphs if key[1] is not None]
                assert len(keys) == 2, "one captured graph per CFG branch's cache"
    assert len({str(r) for r in runs.values()}) == 1, runs
    hashes, summary = runs["fp8-fused", True]
    assert hashes != exact and summary.mean_skipped() > 0
    pipe.set_variant("fp8-fused")
    pipe.cuda_graphs = True
    assert [png_sha256(im) for im in pipe.generate(PROMPTS, **ARGS)] == exact


@pytest.mark.parametrize("variant", ["fp8-fused", "fp8-unfused"])
@pytest.mark.parametrize(
    ("preset", "text", "blocks", "lend"),
    [
        (ALWAYS, ("offload", 0), 0, False),  # everything streamed
        (ALWAYS_BACK, ("offload", 0), 0, False),  # the last block runs after the skipped ones
        (CACHE_PRESETS["faster"], ("offload", 2), 1, False),
        (ALWAYS, ("offload", 1), 4, True),  # resident blocks lend the text encoder their memory
    ],
    ids=["streamed", "streamed-back-block", "faster", "lent"],
)
def test_streamed_placements_with_a_cache_equal_resident(fp8_dir, variant, preset, text, blocks, lend):
    resident = load_pipeline(fp8_dir, variant=variant, device="cuda")
    expected = [png_sha256(im) for im in resident.generate(PROMPTS, **ARGS, cache=preset)]
    summary = resident.last_run.cache
    assert summary.mean_skipped() > 0
    pipe = placed_pipeline(
        fp8_dir, variant, text, blocks, CudaLink(torch.device("cuda")), precision=GPU, lend=lend
    )
    assert pipe.cuda_graphs and pipe.memory.plan.placement("transformer").streamed
    for graphs in (True, True, False):  # captured, replayed, eager
        pipe.cuda_graphs = graphs
        assert [png_sha256(im) for im in pipe.generate(PROMPTS, **ARGS, cache=preset)] == expected, graphs
        assert pipe.last_run.cache == summary


def test_dropped_graphs_let_go_of_their_cache_buffers(fp8_dir):
    """Prompts of four lengths and one negative prompt: five graphs for at most four kept; the buffers
    left in the caches are exactly those of the graphs kept."""
    pipe = load_pipeline(fp8_dir, device="cuda")
    prompts = [
        "a fox",
        "a red fox in snow",
        "a red fox in deep snow at night",
        "a castle on a hill, stars, moon, a lake",
    ]
    for prompt in prompts:
        pipe.generate(prompt, **ARGS, cache=ALWAYS)
    kept = {key for key in pipe._graphed.graphs if key[1] is not None}
    owners = {key[0] for cache in pipe._caches.values() for key in cache.buffers}
    assert len(kept) == pipe._graphed.max_graphs and owners == kept
