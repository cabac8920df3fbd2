"""GPU (H200) checks of img2img and inpainting: fused and unfused FP8 give identical PNGs, the CUDA-graph run
equals the eager one, and reference mode (FP32 on CUDA) equals diffusers' QwenImageImg2ImgPipeline and
QwenImageInpaintPipeline on the same weights."""

import numpy as np
import pytest
import torch
from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline
from helpers import diffusers_twin, png_sha256
from test_img2img_oracle import ellipse_mask, photo

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu
IMAGE, MASK = photo(301, 203), ellipse_mask(301, 203)
ARGS = dict(negative_prompt="blurry", width=256, height=176, num_inference_steps=10, seed=3, strength=0.7)
PROMPTS = ["a red fox in the snow", "一只熊猫在竹林里"]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8start") / "model"
    return quantize_checkpoint(None, out, prompts=["a red fox", "一只熊猫"], steps=4, size=128, device="cuda")


@pytest.mark.parametrize("masked", [False, True], ids=["img2img", "inpaint"])
def test_fused_equals_unfused_and_graphs_equal_eager(fp8_dir, masked):
    pipe = load_pipeline(fp8_dir, device="cuda")
    assert pipe.cuda_graphs and pipe.variant == "fp8-fused"
    start = dict(init_image=IMAGE, mask_image=MASK if masked else None)
    runs = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        for graphs in (True, False):
            pipe.cuda_graphs = graphs
            runs[variant, graphs] = [png_sha256(im) for im in pipe.generate(PROMPTS, **ARGS, **start)]
    assert len({str(r) for r in runs.values()}) == 1, runs
    pipe.set_variant("fp8-fused")
    pipe.cuda_graphs = True
    plain = [png_sha256(im) for im in pipe.generate(PROMPTS, **(ARGS | {"strength": None}))]
    assert plain != runs["fp8-fused", True] and len(set(plain)) == len(PROMPTS)


@pytest.mark.parametrize("masked", [False, True], ids=["img2img", "inpaint"])
def test_reference_mode_matches_diffusers_on_cuda(masked):
    ours = load_pipeline(variant="reference", device="cuda", dtype="fp32")
    theirs = diffusers_twin(ours, QwenImageInpaintPipeline if masked else QwenImageImg2ImgPipeline)
    args = dict(ARGS, true_cfg_scale=4.0)
    seed = args.pop("seed")
    got = ours.generate(PROMPTS, seed=seed, init_image=IMAGE, mask_image=MASK if masked else None, **args)
    extra = {"mask_image": MASK} if masked else {}
    expected = theirs(
        prompt=PROMPTS,
        image=IMAGE,
        generator=torch.Generator("cpu").manual_seed(seed),
        max_sequence_length=512,
        **extra,
        **args,
    ).images
    for a, b in zip(got, expected, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
