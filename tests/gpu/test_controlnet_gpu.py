"""GPU (H200) checks of the ControlNet: fused and unfused FP8 give identical PNGs (the ControlNet calibrated
and fused too; the inpainting ControlNet as well), CUDA-graph replays equal eager runs, and reference mode
(FP32 on CUDA) equals diffusers' QwenImageControlNetPipeline with one and two control maps."""

import numpy as np
import pytest
import torch
from controlnet_fixtures import build_controlnet_checkpoint, depth_map, edge_map
from helpers import png_sha256
from test_controlnet import diffusers_controlnet_pipeline
from test_img2img_oracle import ellipse_mask, photo

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint
from qwen_image_fusion.pipelines.requests import Request

pytestmark = pytest.mark.gpu
MAPS = [edge_map(257, 177, seed=4), depth_map(257, 177)]
ARGS = dict(negative_prompt="blurry", width=256, height=176, num_inference_steps=8, seed=3)
PROMPTS = ["a red fox in the snow", "一只熊猫在竹林里"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_controlnet_checkpoint(tmp_path_factory.mktemp("cn") / "model")


@pytest.fixture(scope="module")
def fp8_dir(checkpoint, tmp_path_factory):
    """Calibrated on a prompt and a request guided by a drawn edge map (the built-in `control` set's canny
    mode needs scikit-image, which the GPU machine lacks)."""
    work = tmp_path_factory.mktemp("fp8cn")
    edge_map(256, 176, seed=1).save(work / "edges.png")
    prompts = ["a red fox", Request("a house", control=(work / "edges.png",))]
    return quantize_checkpoint(checkpoint, work / "model", prompts=prompts, steps=4, size=128, device="cuda")


def variant_runs(pipe, control: dict) -> dict[tuple[str, bool], list[str]]:
    """The PNG hashes of the prompts with `control`, by (variant, CUDA graphs on)."""
    runs = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        for graphs in (True, False):
            pipe.cuda_graphs = graphs
            runs[variant, graphs] = [png_sha256(im) for im in pipe.generate(PROMPTS, **ARGS, **control)]
    return runs


@pytest.mark.parametrize("maps", [1, 2])
def test_fused_equals_unfused_and_graphs_equal_eager(fp8_dir, maps):
    pipe = load_pipeline(fp8_dir, device="cuda")
    assert pipe.cuda_graphs and pipe.variant == "fp8-fused"
    net = pipe.components.controlnet
    assert sum(d.fused for d in net.fusion_report.block) == 4 * len(net.transformer_blocks)
    control = dict(control_image=MAPS[:maps], controlnet_conditioning_scale=[0.9, 0.6][:maps])
    runs = variant_runs(pipe, control)
    assert len({str(r) for r in runs.values()}) == 1, runs
    pipe.set_variant("fp8-fused")
    pipe.cuda_graphs = True
    plain = [png_sha256(im) for im in pipe.generate(PROMPTS, **ARGS)]
    assert plain != runs["fp8-fused", True] and len(set(plain)) == len(PROMPTS)


@pytest.mark.parametrize("maps", [1, 2])
def test_reference_mode_matches_diffusers_on_cuda(checkpoint, maps):
    ours = load_pipeline(checkpoint, variant="reference", device="cuda", dtype="fp32")
    theirs = diffusers_controlnet_pipeline(ours, checkpoint, multi=maps > 1)
    args = dict(ARGS, true_cfg_scale=4.0, control_guidance_end=0.75)
    seed = args.pop("seed")
    control = dict(control_image=MAPS[:maps], controlnet_conditioning_scale=[0.9, 0.6][:maps])
    if maps == 1:
        control = {k: v[0] for k, v in control.items()}
    got = ours.generate(PROMPTS, seed=seed, **control, **args)
    expected = theirs(
        prompt=PROMPTS,
        generator=torch.Generator("cpu").manual_seed(seed),
        max_sequence_length=512,
        **control,
        **args,
    ).images
    for a, b in zip(got, expected, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_inpainting_controlnet_fused_equals_unfused_and_graphs_equal_eager(tmp_path):
    checkpoint = build_controlnet_checkpoint(tmp_path / "inpaint", seed=8, inpaint=True)
    fp8 = quantize_checkpoint(checkpoint, tmp_path / "fp8", steps=4, size=128, device="cuda")
    pipe = load_pipeline(fp8, device="cuda")
    runs = variant_runs(pipe, dict(control_image=photo(301, 207), control_mask=ellipse_mask(301, 207)))
    assert len({str(r) for r in runs.values()}) == 1, runs
