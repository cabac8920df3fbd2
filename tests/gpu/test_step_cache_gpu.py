"""GPU (H200) checks of the step cache inside the CUDA-graph step: the graphed run (both ways of each
decision captured, one replayed per call) gives the eager run's bytes and skips the same steps, fused and
unfused FP8 stay byte-identical with a cache, and caching off is still the exact graphed path."""

import math

import pytest
from helpers import png_sha256

from models.cache_presets import CACHE_PRESETS, CachePreset
from pipelines import load_pipeline
from pipelines.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu
ALWAYS = CachePreset("always", threshold=math.inf, warmup_steps=2, max_cached_in_a_row=2)
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
    assert hashes != exact and "skipped in 0 of" not in summary
    pipe.set_variant("fp8-fused")
    pipe.cuda_graphs = True
    assert [png_sha256(im) for im in pipe.generate(PROMPTS, **ARGS)] == exact
