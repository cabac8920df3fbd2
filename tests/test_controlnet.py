"""ControlNet (diffusers' QwenImageControlNetPipeline, the InstantX Union layout, and
QwenImageControlNetInpaintPipeline) on checkpoints written by diffusers' own QwenImageControlNetModel:
reference mode pixel-identical to diffusers with one and two control maps (or an image and its mask),
several scales, guidance windows and true CFG on and off; FP8 (the ControlNet calibrated and written by
`quantize` too) fused == unfused; and every refusal in one line before any weight is read."""

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from controlnet_fixtures import build_controlnet_checkpoint, depth_map, edge_map
from diffusers import (
    QwenImageControlNetInpaintPipeline,
    QwenImageControlNetModel,
    QwenImageControlNetPipeline,
    QwenImageMultiControlNetModel,
    QwenImageTransformer2DModel,
)
from helpers import REPO
from test_img2img_oracle import ellipse_mask, photo

from qwen_image_fusion.models.errors import CheckpointError, InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.qwen_image.model import draw_noise
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.control import control_map
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

STEPS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_controlnet_checkpoint(tmp_path_factory.mktemp("cn") / "controlnet-model")


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_pipeline(checkpoint, variant="reference", device="cpu", dtype="fp32")


def diffusers_controlnet_pipeline(ours, checkpoint, multi: bool, cls: type = QwenImageControlNetPipeline):
    """diffusers' pipeline `cls` around our text encoder, tokenizer and VAE, its own transformer holding our
    transformer's weights and its own ControlNet read from the checkpoint's folder."""
    c = ours.components
    config = {k: v for k, v in c.transformer.config.to_dict().items() if not k.startswith("_")}
    transformer = QwenImageTransformer2DModel(**config).to(ours.device, ours.dtype).eval()
    transformer.load_state_dict(c.transformer.state_dict(), strict=True)
    net = QwenImageControlNetModel.from_pretrained(checkpoint / "controlnet", torch_dtype=ours.dtype)
    net = net.to(ours.device).eval()
    theirs = cls(
        scheduler=copy.deepcopy(c.scheduler),
        vae=c.vae,
        text_encoder=c.text_encoder,
        tokenizer=c.tokenizer,
        transformer=transformer,
        controlnet=QwenImageMultiControlNetModel([net]) if multi else net,
    )
    theirs.set_progress_bar_config(disable=True)
    return theirs


# (prompt, negative, maps, scales, guidance start, end, images per prompt). Padded prompt batches with
# several images per prompt are left out: diffusers tiles their padding masks in another order than the
# embeddings (tests/test_pipeline_oracle.py), a bug we do not copy.
CASES = [
    ("a red fox in the snow", "blurry", ("edges",), 0.7, 0.0, 1.0, 1),
    ("a house by a lake", "blurry", ("edges", "depth"), [0.8, 0.5], 0.0, 0.8, 1),
    (["a cat", "一只熊猫在竹林里"], ["blurry", "low quality"], ("depth",), 1.3, 0.25, 1.0, 1),
    ("a boat", None, ("edges", "depth"), [1.0, 0.0], 0.0, 1.0, 2),
]


@pytest.mark.parametrize(("prompt", "negative", "maps", "scales", "start", "end", "per_prompt"), CASES)
def test_controlnet_matches_diffusers_pixel_for_pixel(
    ours, checkpoint, prompt, negative, maps, scales, start, end, per_prompt
):
    width, height = 64, 48
    drawn = {"edges": edge_map(67, 50, seed=2), "depth": depth_map(67, 50)}  # resized to the request
    images = [drawn[name] for name in maps]
    multi = len(images) > 1
    kwargs = dict(
        width=width,
        height=height,
        num_inference_steps=STEPS,
        true_cfg_scale=1.0 if negative is None else 4.0,
        control_image=images if multi else images[0],
        controlnet_conditioning_scale=scales,
        control_guidance_start=start,
        control_guidance_end=end,
    )
    got = ours.generate(prompt, negative_prompt=negative, seed=11, num_images_per_prompt=per_prompt, **kwargs)
    expected = diffusers_controlnet_pipeline(ours, checkpoint, multi)(
        prompt=prompt,
        negative_prompt=negative,
        generator=torch.Generator("cpu").manual_seed(11),
        num_images_per_prompt=per_prompt,
        max_sequence_length=512,
        **kwargs,
    ).images
    assert len(got) == len(expected) == (1 if isinstance(prompt, str) else len(prompt)) * per_prompt
    for a, b in zip(got, expected, strict=True):
        assert a.size == (width, height)
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_control_changes_the_image_and_its_scale_matters(ours):
    """Not a no-op: scale 0 and scale 1 differ, and so does another map at the same scale."""
    kwargs = dict(width=64, height=48, num_inference_steps=STEPS, seed=4, output_type="latent")
    edges, depth = edge_map(64, 48), depth_map(64, 48)
    off = ours.generate("a tree", control_image=edges, controlnet_conditioning_scale=0.0, **kwargs)
    on = ours.generate("a tree", control_image=edges, controlnet_conditioning_scale=1.0, **kwargs)
    other = ours.generate("a tree", control_image=depth, controlnet_conditioning_scale=1.0, **kwargs)
    assert not torch.equal(off, on) and not torch.equal(on, other)


def test_text_to_image_on_a_controlnet_checkpoint_equals_qwen_image(ours):
    """Without control maps the ControlNet never runs: the transformer's bytes as a plain checkpoint's."""
    plain = load_pipeline(None, variant="reference", device="cpu", dtype="fp32")
    kwargs = dict(width=64, height=48, num_inference_steps=2, seed=5, output_type="latent")
    assert torch.equal(ours.generate("a bird", **kwargs), plain.generate("a bird", **kwargs))


@pytest.fixture(scope="module")
def fp8(checkpoint, tmp_path_factory):
    """The checkpoint quantized on its built-in calibration (text prompts and the `control` set)."""
    return quantize_checkpoint(
        checkpoint, tmp_path_factory.mktemp("q") / "fp8", steps=2, size=64, device="cpu"
    )


def test_fp8_quantize_writes_the_controlnet_and_fused_equals_unfused(fp8):
    config = json.loads((fp8 / "controlnet" / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == "FP8"
    assert config["_class_name"] == "QwenImageControlNetModel"
    assert inspect_checkpoint(fp8).takes_control and inspect_checkpoint(fp8).fp8
    pipe = load_pipeline(fp8, variant="fp8-fused", device="cpu", dtype="bf16")
    net = pipe.components.controlnet
    blocks = len(net.transformer_blocks)
    assert sum(d.fused for d in net.fusion_report.block) == 4 * blocks  # every block's norm paths
    assert "controlnet: FP8 norm+quant fusion" in pipe.fusion_summary()
    kwargs = dict(
        width=64,
        height=48,
        num_inference_steps=3,
        true_cfg_scale=4.0,
        negative_prompt="blurry",
        seed=3,
        control_image=[edge_map(64, 48), depth_map(64, 48)],
        controlnet_conditioning_scale=[0.9, 0.4],
        output_type="latent",
    )
    fused = pipe.generate("a house", **kwargs)
    pipe.set_variant("fp8-unfused")
    assert pipe.variant == "fp8-unfused"
    assert not any(d.fused for d in net.fusion_report.block)
    assert torch.equal(fused, pipe.generate("a house", **kwargs))


@pytest.mark.cpu_dtype
def test_eval_parity_over_the_control_set_finds_fused_and_unfused_identical(fp8, tmp_path):
    """The built-in `control` set (the drawn scenes' canny edges; each output at its map's aspect, scaled to
    the checkpoint's default area: here a copy's, 128x128 in place of the embedded default's 256x256)."""
    small = Path(shutil.copytree(fp8, tmp_path / "fp8"))
    index = json.loads((small / "model_index.json").read_text())
    index["_generation_defaults"] |= {"width": 128, "height": 128}
    (small / "model_index.json").write_text(json.dumps(index))
    command = [sys.executable, "-m", "qwen_image_fusion.eval.parity", "--model", str(small), "--prompts",
               "control", "--a", "fp8-unfused", "--b", "fp8-fused", "--steps", "2", "--out",
               str(tmp_path / "out"), "--expect", "identical"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verdict: PASS (identical on all 6 pairs)" in result.stdout
    pairs = json.loads((tmp_path / "out" / "report.json").read_text())["pairs"]
    assert all(p["control"][0].endswith(".png") for p in pairs)
    sizes = {(p["width"], p["height"]) for p in pairs}
    assert len(sizes) > 1  # the maps' own aspects, not one forced size
    assert all(96 * 96 < w * h <= 128 * 128 for w, h in sizes)  # the copy's default area


def test_canny_mode_makes_an_edge_map_from_a_photo():
    y, x = np.mgrid[0:48, 0:64]
    photo = np.where((x > 20) & (x < 44) & (y > 12) & (y < 36), 200, 40).astype(np.uint8)
    edges = np.asarray(control_map(PIL.Image.fromarray(photo).convert("RGB"), "canny"))
    assert edges.shape == (48, 64, 3) and set(np.unique(edges)) == {0, 255}
    border = np.zeros((48, 64), bool)
    border[11:38, 19:46] = True
    border[14:34, 22:42] = False  # the rectangle's outline, a pixel or two either side
    assert edges[..., 0][~border].max() == 0 and edges[..., 0][border].sum() > 255 * 60


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(control_image=edge_map(64, 48), controlnet_conditioning_scale=[0.5, 0.5]), "has 2 values"),
        (dict(control_image=edge_map(64, 48), control_mode="sketch"), "control_mode 'sketch' is not one"),
        (dict(control_image=edge_map(64, 48), control_mode="depth"), "give the depth map itself"),
        (dict(control_image=edge_map(48, 64)), "would be stretched"),
        (dict(control_image=edge_map(64, 48), control_guidance_start=0.6, control_guidance_end=0.5), "below"),
        (dict(control_image=edge_map(64, 48), controlnet_conditioning_scale=float("nan")), "finite"),
        (dict(control_image="edges.png"), "not a PIL image"),
        (dict(controlnet_conditioning_scale=0.5), "needs the control image"),
        (dict(control_image=edge_map(64, 48), init_image=edge_map(64, 48)), "does not combine"),
        (dict(control_image=edge_map(64, 48), cache="fast"), "step cache is not built"),
    ],
)
def test_bad_control_requests_are_refused_in_one_line(ours, values, message):
    with pytest.raises(InputError, match=message):
        ours.request("a cat", width=64, height=48, **values)


def test_control_on_a_model_without_controlnet_is_refused():
    plain = inspect_checkpoint(None)
    from qwen_image_fusion.pipelines.generation_request import resolve_request

    with pytest.raises(InputError, match="needs a ControlNet"):
        resolve_request(plain, "a cat", control_image=edge_map(64, 48))


def mutated(checkpoint, tmp_path, change) -> object:
    copy_dir = tmp_path / "bad"
    shutil.copytree(checkpoint, copy_dir)
    path = copy_dir / "controlnet" / "config.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    for weights in (copy_dir / "controlnet").glob("*.safetensors"):
        weights.write_bytes(b"not weights")  # refused from the configs: the weights are never read
    return copy_dir


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c | {"joint_attention_dim": 48}, "joint_attention_dim 48 differs"),
        (lambda c: c | {"num_attention_heads": 2}, "inner_dim 64 differs"),
        (
            lambda c: c | {"extra_condition_channels": 4},
            "but a QwenImageControlNetPipeline ControlNet takes 0",
        ),
        (lambda c: c | {"_class_name": "FluxControlNetModel"}, "not a QwenImageControlNetModel"),
    ],
)
def test_mismatched_controlnets_are_refused_before_weights(checkpoint, tmp_path, change, message):
    with pytest.raises(CheckpointError, match=message):
        load_pipeline(mutated(checkpoint, tmp_path, change), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def inpaint_checkpoint(tmp_path_factory):
    return build_controlnet_checkpoint(tmp_path_factory.mktemp("cni") / "inpaint-model", seed=8, inpaint=True)


@pytest.fixture(scope="module")
def inpainting(inpaint_checkpoint):
    return load_pipeline(inpaint_checkpoint, variant="reference", device="cpu", dtype="fp32")


@pytest.mark.parametrize(
    ("prompt", "negative", "scale", "end", "per_prompt"),
    [
        ("a red fox in the snow", "blurry", 0.9, 1.0, 1),
        (["a cat", "一只熊猫在竹林里"], ["blurry", "low quality"], 1.2, 0.7, 1),
        ("a boat", None, 0.6, 1.0, 2),
    ],
)
def test_inpainting_controlnet_matches_diffusers_pixel_for_pixel(
    inpainting, inpaint_checkpoint, prompt, negative, scale, end, per_prompt
):
    """diffusers samples the masked image's latents from torch's global RNG; ours continue the request's
    generator after the noise (one seed, one image): the oracle hands diffusers that generator's state."""
    width, height = 64, 48
    kwargs = dict(
        width=width,
        height=height,
        num_inference_steps=STEPS,
        true_cfg_scale=1.0 if negative is None else 4.0,
        control_image=photo(71, 53),
        control_mask=ellipse_mask(71, 53),
        controlnet_conditioning_scale=scale,
        control_guidance_end=end,
    )
    got = inpainting.generate(
        prompt, negative_prompt=negative, seed=7, num_images_per_prompt=per_prompt, **kwargs
    )
    rows = len(got)
    theirs = diffusers_controlnet_pipeline(
        inpainting, inpaint_checkpoint, False, QwenImageControlNetInpaintPipeline
    )
    generator = torch.Generator("cpu").manual_seed(7)
    draw_noise(rows, 16, inpainting.model.canvas(width, height), generator, "cpu", torch.float32)
    torch.set_rng_state(generator.get_state())  # after building diffusers' modules: their init draws from it
    expected = theirs(
        prompt=prompt,
        negative_prompt=negative,
        generator=torch.Generator("cpu").manual_seed(7),
        num_images_per_prompt=per_prompt,
        max_sequence_length=512,
        **kwargs,
    ).images
    assert rows == len(expected) == (1 if isinstance(prompt, str) else len(prompt)) * per_prompt
    for a, b in zip(got, expected, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_inpainting_controlnet_reads_the_mask(inpainting):
    kwargs = dict(
        width=64, height=48, num_inference_steps=2, seed=2, output_type="latent", control_image=photo(64, 48)
    )
    ellipse = inpainting.generate("a fox", control_mask=ellipse_mask(64, 48), **kwargs)
    nothing = inpainting.generate("a fox", control_mask=PIL.Image.new("L", (64, 48)), **kwargs)
    assert not torch.equal(ellipse, nothing)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(control_image=photo(64, 48)), "control_mask is required"),
        (dict(control_image=photo(64, 48), control_mask=ellipse_mask(32, 24)), "control_mask is 32x24"),
        (
            dict(control_image=[photo(64, 48)] * 2, control_mask=ellipse_mask(64, 48)),
            "takes one image, not 2",
        ),
        (dict(control_mask=ellipse_mask(64, 48)), "control_mask needs the control image"),
    ],
)
def test_bad_inpainting_control_is_refused_in_one_line(inpainting, values, message):
    with pytest.raises(InputError, match=message):
        inpainting.request("a cat", width=64, height=48, **values)


def test_a_mask_for_a_controlnet_that_does_not_inpaint_is_refused(ours):
    with pytest.raises(InputError, match="control_mask needs an inpainting ControlNet"):
        ours.request(
            "a cat", width=64, height=48, control_image=edge_map(64, 48), control_mask=ellipse_mask(64, 48)
        )


def test_inpainting_fp8_quantize_and_fused_equals_unfused(inpaint_checkpoint, tmp_path):
    """The default calibration of an inpainting ControlNet is the built-in `control-inpaint` set."""
    fp8 = quantize_checkpoint(inpaint_checkpoint, tmp_path / "fp8", steps=2, size=64, device="cpu")
    config = json.loads((fp8 / "controlnet" / "config.json").read_text())
    assert config["extra_condition_channels"] == 4 and config["quantization_config"]["quant_algo"] == "FP8"
    assert (
        json.loads((fp8 / "model_index.json").read_text())["_class_name"]
        == "QwenImageControlNetInpaintPipeline"
    )
    pipe = load_pipeline(fp8, variant="fp8-fused", device="cpu", dtype="bf16")
    kwargs = dict(width=64, height=48, num_inference_steps=3, true_cfg_scale=4.0, negative_prompt="blurry",
                  seed=3, control_image=photo(64, 48), control_mask=ellipse_mask(64, 48),
                  output_type="latent")  # fmt: skip
    fused = pipe.generate("a house", **kwargs)
    pipe.set_variant("fp8-unfused")
    assert torch.equal(fused, pipe.generate("a house", **kwargs))


def test_a_pipeline_class_and_controlnet_of_other_kinds_are_refused(checkpoint, tmp_path):
    """An inpainting pipeline class over a ControlNet that does not read a mask: refused before weights."""
    wrong = tmp_path / "wrong"
    shutil.copytree(checkpoint, wrong)
    index = json.loads((wrong / "model_index.json").read_text())
    (wrong / "model_index.json").write_text(
        json.dumps(index | {"_class_name": "QwenImageControlNetInpaintPipeline"})
    )
    with pytest.raises(CheckpointError, match="a QwenImageControlNetInpaintPipeline ControlNet takes 4"):
        inspect_checkpoint(wrong)


def test_a_lora_on_a_controlnet_checkpoint_keeps_fused_equal_to_unfused(fp8, tmp_path):
    """A Lightning-layout LoRA mounts on the transformer (branch mode) beside the ControlNet: it changes the
    image, both modules stay fused, and fused == unfused with control maps."""
    from lora_files import block_modules, linear_shapes, random_factors, write_lightning

    pipe = load_pipeline(fp8, variant="fp8-fused", device="cpu", dtype="bf16")
    shapes = linear_shapes(pipe.transformer)
    modules = block_modules(pipe.transformer.config.num_layers)
    factors = random_factors(shapes, modules, 8, seed=5, std=0.2, dtype=torch.bfloat16)
    lora = write_lightning(tmp_path / "lightning.safetensors", factors, 2.0)
    kwargs = dict(width=64, height=48, num_inference_steps=2, true_cfg_scale=4.0, negative_prompt="blurry",
                  seed=3, control_image=edge_map(64, 48), output_type="latent")  # fmt: skip
    base = pipe.generate("a house", **kwargs)
    pipe.load_lora(lora, scale=0.8)
    net = pipe.components.controlnet
    assert all(d.fused for d in net.fusion_report.block)
    fused = pipe.generate("a house", **kwargs)
    assert not torch.equal(base, fused) and "lightning x0.8" in pipe.last_run.loras
    pipe.set_variant("fp8-unfused")
    assert torch.equal(fused, pipe.generate("a house", **kwargs))
