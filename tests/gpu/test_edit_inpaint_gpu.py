"""GPU (H200) checks of inpainting edits (`QwenImageEditInpaintPipeline`) on a tiny Edit checkpoint built by
tests/edit_fixtures.py, at diffusers' own image areas (a 1024x768 input: 1184x896 output and reference): on
its FP8 version, quantized here on CUDA, fused and unfused give identical PNGs with and without
`padding_mask_crop`, and CUDA-graph replays give the eager run's bytes; reference mode (FP32 on CUDA) equals
diffusers' pipeline on the BF16 checkpoint."""

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditInpaintPipeline
from edit_fixtures import build_edit_checkpoint, diffusers_edit_pipeline, drawn_image
from helpers import png_sha256
from test_img2img_oracle import ellipse_mask

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint
from qwen_image_fusion.pipelines.requests import edit_requests_for

pytestmark = pytest.mark.gpu
IMAGE, MASK = drawn_image(1024, 768, 11), ellipse_mask(1024, 768)
ARGS = dict(negative_prompt="blurry", num_inference_steps=8, seed=3, strength=0.7)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("edit-inpaint-gpu")
    bf16 = build_edit_checkpoint(root / "bf16", "QwenImageEditPipeline", False, seed=9)
    requests = edit_requests_for(1)
    fp8 = quantize_checkpoint(
        bf16, root / "fp8", [requests[0], requests[-1]], steps=4, size=256, device="cuda"
    )
    return {"bf16": bf16, "fp8": fp8}


@pytest.mark.parametrize("crop", [None, 32], ids=["whole", "padding_mask_crop"])
def test_fused_equals_unfused_and_graphs_equal_eager(checkpoints, crop):
    pipe = load_pipeline(checkpoints["fp8"], device="cuda")
    assert pipe.cuda_graphs and pipe.variant == "fp8-fused"
    runs = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        for graphs in (True, False):
            pipe.cuda_graphs = graphs
            images = pipe.generate(
                "paint a red ball", image=IMAGE, mask_image=MASK, padding_mask_crop=crop, **ARGS
            )
            runs[variant, graphs] = [png_sha256(image) for image in images]
    assert len({str(r) for r in runs.values()}) == 1, runs
    pipe.set_variant("fp8-fused")
    pipe.cuda_graphs = True
    plain = pipe.generate("paint a red ball", image=IMAGE, **(ARGS | {"strength": None}))
    assert [png_sha256(image) for image in plain] != runs["fp8-fused", True]


def test_reference_mode_matches_diffusers_on_cuda(checkpoints):
    ours = load_pipeline(checkpoints["bf16"], variant="reference", device="cuda", dtype="fp32")
    edit = diffusers_edit_pipeline(checkpoints["bf16"], torch.float32).to("cuda")
    theirs = QwenImageEditInpaintPipeline(**edit.components)
    theirs.set_progress_bar_config(disable=True)
    args = dict(ARGS, true_cfg_scale=4.0)
    seed = args.pop("seed")
    got = ours.generate("paint a red ball", image=IMAGE, mask_image=MASK, seed=seed, **args)
    expected = theirs(
        image=IMAGE,
        prompt="paint a red ball",
        mask_image=MASK,
        generator=torch.Generator("cpu").manual_seed(seed),
        **args,
    ).images
    assert len(got) == len(expected) == 1
    assert np.array_equal(np.asarray(got[0]), np.asarray(expected[0]))
