"""Qwen-Image-Layered (diffusers' QwenImageLayeredPipeline) on checkpoints written by diffusers' own
classes: reference mode pixel-identical to diffusers with 2 to 4 layers, the Layered transformer (layer-3D
RoPE, task embedding, RGBA VAE) and the plain one diffusers' own tests build (RGB VAE), true CFG on and
off, two prompts, two images per prompt; FP8 (calibrated and written by `quantize`) fused == unfused; and
every refusal in one line before anything runs."""

import json
import shutil
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import torch
from edit_fixtures import drawn_image
from helpers import REPO
from layered_fixtures import (
    build_layered_checkpoint,
    diffusers_layered_pipeline,
    diffusers_layers,
    small_layered_area,
    small_size,
)

from qwen_image_fusion.models.errors import CheckpointError, InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.options import DEFAULT_LAYERS, MAX_LAYERS
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("layered")
    return {
        "layered": build_layered_checkpoint(root / "layered", flags=True, channels=4, seed=0),
        "plain": build_layered_checkpoint(root / "plain", flags=False, channels=3, seed=5),
    }


@pytest.fixture(scope="module")
def ours(checkpoints):
    return {
        name: load_pipeline(path, variant="reference", device="cpu", dtype="fp32")
        for name, path in checkpoints.items()
    }


@pytest.fixture(scope="module")
def theirs(checkpoints):
    """diffusers' pipeline of each checkpoint, loaded once (each call sets its own scheduler and inputs)."""
    return {name: diffusers_layered_pipeline(path) for name, path in checkpoints.items()}


CASES = [  # checkpoint, prompts, negative prompt, layers, images per prompt, image (width, height, mode)
    ("layered", ["a red cat on a mat"], "blurry", 3, 1, (120, 90, "RGBA")),
    ("layered", ["a red cat on a mat"], None, 2, 1, (160, 80, "RGB")),
    ("layered", ["a poster", "two birds on a wire above a long road"], "blurry", 4, 1, (80, 150, "RGBA")),
    ("layered", ["a poster"], "blurry", 2, 2, (100, 100, "RGBA")),
    ("plain", ["a poster", "two birds on a wire above a long road"], "blurry", 2, 1, (100, 100, "RGB")),
    ("plain", ["a poster"], None, 3, 2, (90, 120, "RGB")),
]


@pytest.mark.parametrize(("name", "prompts", "negative", "layers", "per_prompt", "image"), CASES)
def test_layers_match_diffusers_pixel_for_pixel(
    theirs, ours, name, prompts, negative, layers, per_prompt, image
):
    width, height, image_mode = image
    picture = drawn_image(width, height, layers, image_mode)
    pipe = ours[name]
    mode = pipe.model.pixel_mode()
    expected = diffusers_layers(
        theirs[name],
        picture.convert(mode),
        prompts,
        negative,
        layers,
        per_prompt=per_prompt,
        seed=7,
    )
    width, height = small_size(picture)
    mine = pipe.generate(
        prompts if len(prompts) > 1 else prompts[0],
        negative_prompt=negative,
        image=picture,
        layers=layers,
        width=width,
        height=height,
        num_inference_steps=2,
        num_images_per_prompt=per_prompt,
        seed=7,
    )
    assert len(mine) == len(expected) == len(prompts) * per_prompt * layers
    assert {m.mode for m in mine} == {"RGBA" if mode == "RGBA" else "RGB"}
    assert all(m.size == (width, height) for m in mine)
    for a, b in zip(expected, mine, strict=True):
        assert a.mode == b.mode and a.tobytes() == b.tobytes()


def test_the_layers_differ_and_depend_on_the_image(ours):
    pipe = ours["layered"]
    args = dict(layers=2, width=64, height=64, num_inference_steps=2, seed=1)
    first = pipe.generate("a cat", image=drawn_image(64, 64, 1, "RGBA"), **args)
    other = pipe.generate("a cat", image=drawn_image(64, 64, 2, "RGBA"), **args)
    assert first[0].tobytes() != first[1].tobytes()
    assert first[0].tobytes() != other[0].tobytes()
    arrays = [np.asarray(layer) for layer in first]
    assert all(a.shape == (64, 64, 4) for a in arrays)


def test_default_request_is_the_640_bucket_with_four_layers(ours):
    request = ours["layered"].request("a cat", image=drawn_image(300, 200, 0))
    assert (request.width, request.height, request.layers) == (768, 512, DEFAULT_LAYERS)
    assert request.true_cfg_scale == 4.0 and request.negative_prompts is None
    big = ours["layered"].request("a cat", image=drawn_image(300, 200, 0), resolution=1024)
    assert (big.width, big.height) == (1248, 832)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(layers=0), f"layers must be an integer in 1..{MAX_LAYERS}"),
        (dict(layers=MAX_LAYERS + 1), "layers must be an integer"),
        (dict(layers=2.5), "layers must be an integer"),
        (dict(use_en_prompt="yes"), "use_en_prompt"),
        (dict(image=None), "works on input images: give at least one"),
        (dict(resolution=640, width=64), "give either resolution or width/height"),
        (dict(resolution=100), "resolution must be an integer in 256..4096"),
        (dict(init_image=drawn_image(64, 64, 0)), "does not start from an image"),
    ],
)
def test_bad_layered_requests_are_refused_in_one_line(ours, values, message):
    values = {"prompt": "a cat", "image": drawn_image(64, 64, 0)} | values
    with pytest.raises(InputError, match=message) as err:
        ours["layered"].request(values.pop("prompt"), **values)
    assert "\n" not in str(err.value)


def test_layers_on_a_model_that_does_not_decompose_are_refused():
    from qwen_image_fusion.pipelines.generation_request import resolve_request

    with pytest.raises(InputError, match="does not decompose images into layers"):
        resolve_request(inspect_checkpoint(None), "a cat", layers=3)
    with pytest.raises(InputError, match="does not caption images"):
        resolve_request(inspect_checkpoint(None), "a cat", use_en_prompt=True)


def test_caption_prompts_are_diffusers_own():
    from diffusers import QwenImageLayeredPipeline

    from qwen_image_fusion.models.qwen_image_layered.caption import CAPTION_PROMPT_CN, CAPTION_PROMPT_EN

    empty = dict.fromkeys(("scheduler", "vae", "text_encoder", "tokenizer", "processor", "transformer"))
    theirs = QwenImageLayeredPipeline(**empty)
    assert (
        theirs.image_caption_prompt_en,
        theirs.image_caption_prompt_cn,
    ) == (CAPTION_PROMPT_EN, CAPTION_PROMPT_CN)


@pytest.mark.parametrize(("prompt", "english"), [("", True), (" ", False)])
def test_an_empty_prompt_is_captioned_as_diffusers_captions_it(theirs, ours, prompt, english, monkeypatch):
    """diffusers captions an empty prompt with the text encoder's generation (the instruction and the image
    resized to the output), then decomposes with that caption: the same caption and the same layers. The
    caption diffusers used is recorded as its pipeline makes it (a caption is 512 generated tokens)."""
    picture = drawn_image(100, 70, 2, "RGBA")
    pipeline = theirs["layered"]
    captions = []

    def get_image_caption(*args, **kwargs):
        captions.append(type(pipeline).get_image_caption(pipeline, *args, **kwargs))
        return captions[-1]

    monkeypatch.setattr(pipeline, "get_image_caption", get_image_caption)
    width, height = small_size(picture)
    with small_layered_area():
        expected = pipeline(
            image=picture, prompt=prompt, negative_prompt="blurry", layers=2, num_inference_steps=2,
            use_en_prompt=english, generator=torch.Generator().manual_seed(3),
        ).images[0]  # fmt: skip
    pipe = ours["layered"]
    got = pipe.generate(
        prompt, image=picture, negative_prompt="blurry", layers=2, width=width, height=height,
        num_inference_steps=2, seed=3, use_en_prompt=english,
    )  # fmt: skip
    assert len(captions) == 1 and captions[0]
    assert pipe.last_run.caption == captions[0]
    assert [a.tobytes() for a in got] == [b.tobytes() for b in expected]


def test_a_layered_transformer_under_another_pipeline_class_is_refused(checkpoints, tmp_path):
    copy = tmp_path / "wrong-class"
    shutil.copytree(checkpoints["layered"], copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps(index | {"_class_name": "QwenImagePipeline"}))
    for weights in copy.rglob("*.safetensors"):
        weights.write_bytes(b"not weights")  # refused from the configs: the weights are never read
    with pytest.raises(
        CheckpointError, match="use_additional_t_cond, use_layer3d_rope is Qwen-Image-Layered"
    ):
        inspect_checkpoint(copy)


def test_memory_plans_and_ulysses_are_refused_for_layered(checkpoints):
    spec = inspect_checkpoint(checkpoints["layered"])
    assert spec.decomposes and spec.images_required and spec.max_images == 1
    assert not spec.sequence_parallel
    assert spec.family.memory_profile(spec, 2, 2) is None


@pytest.fixture(scope="module")
def fp8(checkpoints, tmp_path_factory):
    """The Layered checkpoint quantized on its built-in calibration (the edit set's images and prompts)."""
    return quantize_checkpoint(
        checkpoints["layered"], tmp_path_factory.mktemp("q") / "fp8", steps=2, size=64, device="cpu"
    )


def test_fp8_quantize_keeps_layered_and_fused_equals_unfused(fp8):
    index = json.loads((fp8 / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageLayeredPipeline" and (fp8 / "processor").is_dir()
    spec = inspect_checkpoint(fp8)
    assert spec.fp8 and spec.decomposes
    pipe = load_pipeline(fp8, variant="fp8-fused", device="cpu", dtype="bf16")
    layers = pipe.transformer.config.num_layers
    assert f"{4 * layers}/{4 * layers} block paths" in pipe.fusion_summary()
    args = dict(image=drawn_image(96, 64, 3, "RGBA"), layers=3, num_inference_steps=2, seed=4)
    fused = pipe.generate("a cat", negative_prompt="blurry", width=96, height=64, **args)
    pipe.set_variant("fp8-unfused")
    unfused = pipe.generate("a cat", negative_prompt="blurry", width=96, height=64, **args)
    assert len(fused) == 3
    assert [a.tobytes() for a in fused] == [b.tobytes() for b in unfused]
    assert torch.equal(torch.tensor(np.asarray(fused[0])), torch.tensor(np.asarray(unfused[0])))


@pytest.mark.cpu_dtype
def test_eval_parity_over_the_edit_set_compares_every_layer(fp8, tmp_path):
    """The built-in `edit` set (drawn images and prompts), each request's layers side by side in its PNG."""
    command = [sys.executable, "-m", "qwen_image_fusion.eval.parity", "--model", str(fp8), "--prompts",
               "edit", "--a", "fp8-unfused", "--b", "fp8-fused", "--steps", "2", "--size", "64x48", "--out",
               str(tmp_path / "out"), "--expect", "identical"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verdict: PASS (identical on all" in result.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    first = report["pairs"][0]
    strip = PIL.Image.open(tmp_path / "out" / first["a"]["image"])
    assert strip.size == (64 * DEFAULT_LAYERS, 48) and strip.mode == "RGBA"
    assert len({p["a"]["png_sha256"] for p in report["pairs"]}) == len(report["pairs"]) > 1


def test_a_lora_on_a_layered_checkpoint_keeps_fused_equal_to_unfused(fp8, tmp_path):
    """A Lightning-layout LoRA mounts on the Layered transformer as on Qwen-Image's (branch mode): it changes
    the layers, the blocks stay fused, and fused == unfused."""
    from lora_files import block_modules, linear_shapes, random_factors, write_lightning

    pipe = load_pipeline(fp8, variant="fp8-fused", device="cpu", dtype="bf16")
    shapes = linear_shapes(pipe.transformer)
    modules = block_modules(pipe.transformer.config.num_layers)
    factors = random_factors(shapes, modules, 8, seed=5, std=0.2, dtype=torch.bfloat16)
    lora = write_lightning(tmp_path / "lightning.safetensors", factors, 2.0)
    kwargs = dict(image=drawn_image(64, 48, 1, "RGBA"), layers=2, width=64, height=48, num_inference_steps=2,
                  negative_prompt="blurry", seed=3, output_type="latent")  # fmt: skip
    base = pipe.generate("a cat", **kwargs)
    pipe.load_lora(lora, scale=0.8)
    assert all(d.fused for d in pipe.transformer.fusion_report.block)
    fused = pipe.generate("a cat", **kwargs)
    assert not torch.equal(base, fused) and "lightning x0.8" in pipe.last_run.loras
    pipe.set_variant("fp8-unfused")
    assert torch.equal(fused, pipe.generate("a cat", **kwargs))


def test_gpu_memory_is_refused_for_layered_in_one_line(checkpoints, tmp_path):
    """Memory plans do not place Layered's frames yet: an explicit budget is refused before loading."""
    out = tmp_path / "layers"
    drawn_image(64, 48, 1).save(tmp_path / "image.png")
    command = [sys.executable, "-m", "qwen_image_fusion.ui.cli", "layers", str(tmp_path / "image.png"),
               "--prompt", "a cat", "--model", str(checkpoints["layered"]), "--gpu-memory", "24GiB",
               "-o", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, cwd=REPO)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "memory" in result.stderr, result.stderr
    assert not out.exists()
