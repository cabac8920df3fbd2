"""GPU (H200) checks of Qwen-Image-Layered: fused and unfused FP8 give identical layers, CUDA-graph replays
equal eager runs, and reference mode (FP32 on CUDA) equals diffusers' QwenImageLayeredPipeline."""

import pytest
from edit_fixtures import drawn_image
from helpers import png_sha256
from layered_fixtures import (
    build_layered_checkpoint,
    diffusers_layered_pipeline,
    diffusers_layers,
    small_size,
)

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint
from qwen_image_fusion.pipelines.requests import Request

pytestmark = pytest.mark.gpu
IMAGE = drawn_image(300, 200, 6, "RGBA")
ARGS = dict(negative_prompt="blurry", width=240, height=160, num_inference_steps=6, seed=3, layers=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_layered_checkpoint(tmp_path_factory.mktemp("layered") / "model", seed=2)


@pytest.fixture(scope="module")
def fp8_dir(checkpoint, tmp_path_factory):
    """Calibrated on two requests with the drawn image and a prompt each."""
    work = tmp_path_factory.mktemp("fp8layered")
    IMAGE.save(work / "image.png")
    prompts = [Request(p, images=(work / "image.png",)) for p in ("a poster", "两只鸟")]
    return quantize_checkpoint(checkpoint, work / "model", prompts=prompts, steps=4, size=128, device="cuda")


def test_fused_equals_unfused_and_graphs_equal_eager(fp8_dir):
    pipe = load_pipeline(fp8_dir, device="cuda")
    assert pipe.cuda_graphs and pipe.variant == "fp8-fused"
    blocks = pipe.transformer.transformer_blocks
    assert sum(d.fused for d in pipe.transformer.fusion_report.block) == 4 * len(blocks)
    runs = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        for graphs in (True, False):
            pipe.cuda_graphs = graphs
            layers = pipe.generate(["a poster", "两只鸟"], image=IMAGE, **ARGS)
            runs[variant, graphs] = [png_sha256(layer) for layer in layers]
    assert len({str(r) for r in runs.values()}) == 1, runs
    first = runs["fp8-fused", True]
    assert len(first) == 2 * ARGS["layers"] and len(set(first)) == len(first)


def test_reference_mode_matches_diffusers_on_cuda(checkpoint):
    ours = load_pipeline(checkpoint, variant="reference", device="cuda", dtype="fp32")
    theirs = diffusers_layered_pipeline(checkpoint).to("cuda")
    width, height = small_size(IMAGE)
    got = ours.generate(
        "a poster", image=IMAGE, negative_prompt="blurry", layers=3, width=width, height=height,
        num_inference_steps=4, seed=9,
    )  # fmt: skip
    expected = diffusers_layers(theirs, IMAGE, ["a poster"], "blurry", 3, steps=4, seed=9)
    assert [png_sha256(a) for a in got] == [png_sha256(b) for b in expected]
