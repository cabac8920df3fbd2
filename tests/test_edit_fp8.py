"""FP8 Edit checkpoints on the CPU: `quantize` calibrates Edit, Plus (Edit-2509) and Plus with `zero_cond_t`
(Edit-2511) on the built-in image + instruction pairs, every block path of the result fuses (Edit-2511's
per-token modulation included), and fp8-fused edits (inpainting edits too) are byte-identical PNGs to
fp8-unfused ones. A calibration set the model cannot take is refused before anything loads."""

import json
from pathlib import Path

import pytest
import torch
from edit_fixtures import (
    EDIT_VARIANTS,
    SMALL_CONDITION_AREA,
    SMALL_VAE_AREA,
    build_edit_checkpoints,
    drawn_image,
)
from helpers import png_sha256
from lora_files import block_modules, linear_shapes, random_factors, write_lightning
from test_img2img_oracle import ellipse_mask

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint
from qwen_image_fusion.pipelines.requests import Request, edit_requests_for
from qwen_image_fusion.ui.cli import main

pytestmark = pytest.mark.slow
SEEDS = {"edit": 1, "plus-2509": 3, "plus-2511": 2}


@pytest.fixture(scope="module")
def small_areas():
    """The Edit model at the tests' small image areas (diffusers' are 1024x1024 and 384x384)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("qwen_image_fusion.models.qwen_image_edit.model.VAE_AREA", SMALL_VAE_AREA)
        patch.setattr("qwen_image_fusion.models.qwen_image_edit.model.CONDITION_AREA", SMALL_CONDITION_AREA)
        yield


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> dict[str, Path]:
    return build_edit_checkpoints(tmp_path_factory.mktemp("edit-bf16"), SEEDS)


def calibration(name: str) -> list[Request] | None:
    """Edit-2511 calibrates on the whole built-in set (the default); the others on a part, to stay quick."""
    if name == "plus-2511":
        return None
    requests = edit_requests_for(1 if name == "edit" else 3)
    return [requests[0], requests[-1]]


@pytest.fixture(scope="module")
def fp8(bf16, small_areas, tmp_path_factory) -> dict[str, tuple[Path, list[int]]]:
    """Each checkpoint quantized; with the image count of every calibration request, as `quantize` handed
    them to `generate`."""
    root = tmp_path_factory.mktemp("edit-fp8")
    quantized = {}
    original = Pipeline.generate
    for name, directory in bf16.items():
        seen: list[int] = []

        def spy(self, *args, seen=seen, **kwargs):
            seen.append(len(kwargs.get("image") or []))
            return original(self, *args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Pipeline, "generate", spy)
            out = quantize_checkpoint(
                directory, root / name, calibration(name), steps=2, size=32, device="cpu"
            )
        quantized[name] = (out, seen)
    return quantized


@pytest.mark.cpu_dtype
@pytest.mark.parametrize("name", list(SEEDS))
def test_calibration_edits_image_instruction_pairs(fp8, name: str) -> None:
    """Edit-2511 with no calibration set given: every built-in pair (one to three images)."""
    out, seen = fp8[name]
    requests = calibration(name) or edit_requests_for(3)
    assert seen == [len(request.images) for request in requests]
    assert max(seen) == (1 if name == "edit" else 3)
    config = json.loads((out / "transformer" / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == "FP8"
    assert config["zero_cond_t"] == (name == "plus-2511")
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == EDIT_VARIANTS[name][0] and (out / "processor").is_dir()


@pytest.mark.cpu_dtype
@pytest.mark.parametrize("name", list(SEEDS))
def test_every_path_fuses_and_fused_equals_unfused(fp8, small_areas, name: str) -> None:
    pipe = load_pipeline(fp8[name][0], device="cpu")
    assert pipe.variant == "fp8-fused"
    layers = pipe.transformer.config.num_layers
    summary = pipe.fusion_summary().splitlines()[0]
    assert summary == f"FP8 norm+quant fusion: {4 * layers}/{4 * layers} block paths"
    images = [drawn_image(75, 53, 1), drawn_image(40, 64, 2, "RGBA")][: pipe.spec.max_images]
    args = dict(image=images, negative_prompt="blurry", width=48, height=32, num_inference_steps=3, seed=5)
    fused = [
        png_sha256(image) for image in pipe.generate("make the sky red", num_images_per_prompt=2, **args)
    ]
    pipe.set_variant("fp8-unfused")
    assert pipe.fusion_summary().splitlines()[0] == f"FP8 norm+quant fusion: 0/{4 * layers} block paths"
    unfused = [
        png_sha256(image) for image in pipe.generate("make the sky red", num_images_per_prompt=2, **args)
    ]
    assert fused == unfused
    assert fused[0] != fused[1]


def test_calibration_sets_the_model_cannot_take_are_refused_before_loading(
    bf16, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(
        "qwen_image_fusion.pipelines.quantize.load_pipeline", lambda *a, **k: pytest.fail("loaded")
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n")
    edit_set = tmp_path / "set.jsonl"
    drawn_image(40, 40, 1).save(tmp_path / "a.png")
    edit_set.write_text(json.dumps({"prompt": "two", "images": ["a.png", "a.png"]}) + "\n")
    cases = {
        (
            str(bf16["edit"]),
            str(prompts),
        ): f"request 1 ('a red fox'): {bf16['edit']} works on input images: give at least one input image",
        (
            str(bf16["edit"]),
            str(edit_set),
        ): f"request 1 ('two'): 2 input images, but {bf16['edit']} takes at most 1",
        (
            None,
            str(edit_set),
        ): "request 1 ('two'): embedded-default generates from text only and takes no input images",
    }
    for (model, calib), message in cases.items():
        args = ["quantize", "--out", str(tmp_path / "out"), "--calib-prompts", calib]
        assert main([*args, *(["--model", model] if model else [])]) == 2
        assert capsys.readouterr().err.strip() == f"error: {message}"


@pytest.mark.cpu_dtype
def test_lora_on_fp8_edit_2511_fused_equals_unfused_in_both_modes(fp8, small_areas, tmp_path) -> None:
    """A Lightning-layout LoRA on the FP8 Edit-2511 export: branch mode keeps every path fused (the producers
    write the BF16 input beside the FP8 one), merge folds it into the FP8 weights; in both modes fused and
    unfused edits are the same PNG bytes."""
    pipe = load_pipeline(fp8["plus-2511"][0], device="cpu")
    layers = pipe.transformer.config.num_layers
    modules = block_modules(layers)  # every block linear
    factors = random_factors(linear_shapes(pipe.transformer), modules, 8, seed=3, dtype=torch.bfloat16)
    pipe.load_lora(write_lightning(tmp_path / "edit-lightning.safetensors", factors, alpha=1.0))
    args = dict(image=[drawn_image(60, 40, 3)], width=32, height=32, seed=2, negative_prompt=" ")
    for mode in ("branch", "merge"):
        pipe.set_lora_mode(mode)
        pipe.set_variant("fp8-fused")
        assert (
            pipe.fusion_summary().splitlines()[0]
            == f"FP8 norm+quant fusion: {4 * layers}/{4 * layers} block paths"
        )
        fused = png_sha256(pipe.generate("make it red", preset="edit-lightning-4", **args)[0])
        pipe.set_variant("fp8-unfused")
        unfused = png_sha256(pipe.generate("make it red", preset="edit-lightning-4", **args)[0])
        assert fused == unfused, mode


@pytest.mark.cpu_dtype
def test_an_inpainting_edit_fused_equals_unfused(fp8, small_areas, monkeypatch) -> None:
    """A mask, a strength and `padding_mask_crop` on the FP8 Edit checkpoint: fp8-fused and fp8-unfused give
    the same PNG bytes, with and without the crop, and the crop changes the image."""
    monkeypatch.setattr(
        "qwen_image_fusion.models.qwen_image_edit.config.VAE_AREA", SMALL_VAE_AREA
    )  # the output size too
    pipe = load_pipeline(fp8["edit"][0], device="cpu")
    image, mask = drawn_image(75, 53, 1), ellipse_mask(75, 53)
    args = dict(image=image, mask_image=mask, strength=0.8, negative_prompt="blurry", num_inference_steps=3)
    runs = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        assert pipe.variant == variant
        runs[variant] = [
            png_sha256(image)
            for crop in (None, 2)
            for image in pipe.generate("paint a red ball", padding_mask_crop=crop, seed=5, **args)
        ]
    assert runs["fp8-fused"] == runs["fp8-unfused"]
    assert runs["fp8-fused"][0] != runs["fp8-fused"][1]
