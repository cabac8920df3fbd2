"""LoRA on Edit checkpoints in reference mode against diffusers + PEFT: a file in the Edit Lightning release
layout (`transformer_blocks.N.<module>.lora_down/lora_up/alpha`, the 12 attention and MLP linears of every
block, alpha below the rank as in the Edit-2509/2511 files: rank 64, alpha 8) loaded by our pipeline and by
diffusers' `QwenImageEditPlusPipeline.load_lora_weights` gives the same PNG bytes with the edit Lightning
preset (its scheduler, steps, CFG off) on an Edit-2511-like checkpoint; a kohya LoRA at a scale with true
CFG on an Edit checkpoint likewise; unloading gives the base edit back."""

from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from edit_fixtures import (
    build_edit_checkpoints,
    diffusers_edit,
    diffusers_edit_pipeline,
    drawn_image,
    our_edit_pipeline,
)
from helpers import png_sha256
from lora_files import block_modules, linear_shapes, random_factors, write_kohya, write_lightning

from qwen_image_fusion.models.qwen_image.presets import LIGHTNING_SCHEDULER
from qwen_image_fusion.pipelines.presets import PRESETS

pytestmark = pytest.mark.slow
RELEASE_LINEARS = (  # what the Edit Lightning files target in every block (720 layers in 60 blocks)
    *("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    *("attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj"),
    "txt_mlp.net.2",
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_edit_checkpoints(tmp_path_factory.mktemp("edit-lora"), {"edit": 5, "plus-2511": 6})


def lightning_file(pipe, path: Path) -> Path:
    """Random bf16 factors in the release layout: rank 16 with alpha 2 (the release's 64 / 8 ratio)."""
    layers = pipe.transformer.config.num_layers
    modules = block_modules(layers, RELEASE_LINEARS)
    factors = random_factors(
        linear_shapes(pipe.transformer), modules, 16, seed=7, std=0.2, dtype=torch.bfloat16
    )
    return write_lightning(path, factors, alpha=2.0)


def test_edit_lightning_preset_matches_diffusers_on_edit_2511(checkpoints, tmp_path) -> None:
    ours = our_edit_pipeline(checkpoints["plus-2511"])
    path = lightning_file(ours, tmp_path / "Qwen-Image-Edit-2511-Lightning-4steps-test.safetensors")
    images = [drawn_image(60, 44, 1), drawn_image(37, 52, 2, "P")]
    base = ours.generate("put 1 beside 2", image=images, width=48, height=32, num_inference_steps=4, seed=3)
    assert ours.load_lora(path) == path.stem
    assert ours.loras[path.stem].layers == len(
        block_modules(ours.transformer.config.num_layers, RELEASE_LINEARS)
    )
    args = dict(image=images, width=48, height=32, negative_prompt=" ", seed=3)
    got = ours.generate("put 1 beside 2", preset="edit-lightning-4", **args)
    assert (ours.last_run.num_inference_steps, ours.last_run.preset) == (4, "edit-lightning-4")

    theirs = diffusers_edit_pipeline(checkpoints["plus-2511"])
    theirs.scheduler = FlowMatchEulerDiscreteScheduler.from_config(LIGHTNING_SCHEDULER)
    theirs.load_lora_weights(str(path))
    preset = PRESETS["edit-lightning-4"]
    expected = diffusers_edit(
        theirs, ["put 1 beside 2"], images, " ", (48, 32), preset.num_inference_steps, preset.true_cfg_scale,
        seed=3,
    )  # fmt: skip
    assert png_sha256(got[0]) == png_sha256(expected[0])
    assert png_sha256(got[0]) != png_sha256(base[0]), "the LoRA must change the edit"

    ours.unload_lora()
    again = ours.generate("put 1 beside 2", image=images, width=48, height=32, num_inference_steps=4, seed=3)
    assert png_sha256(again[0]) == png_sha256(base[0])


def test_scaled_kohya_lora_with_true_cfg_matches_diffusers_on_edit(checkpoints, tmp_path) -> None:
    ours = our_edit_pipeline(checkpoints["edit"])
    modules = block_modules(ours.transformer.config.num_layers, ("attn.to_k", "img_mlp.net.2", "txt_mod.1"))
    factors = random_factors(linear_shapes(ours.transformer), modules, 8, seed=8)
    path = write_kohya(tmp_path / "style.safetensors", factors, alpha=4.0)
    ours.load_lora(path, scale=0.7)
    image = drawn_image(75, 53, 3, "RGBA")
    got = ours.generate("make it night", image=image, negative_prompt="blurry", width=32, height=48,
                        num_inference_steps=2, seed=1)  # fmt: skip
    theirs = diffusers_edit_pipeline(checkpoints["edit"])
    theirs.load_lora_weights(str(path), adapter_name="style")
    theirs.set_adapters(["style"], [0.7])
    expected = diffusers_edit(theirs, ["make it night"], [image], "blurry", (32, 48), seed=1)
    assert png_sha256(got[0]) == png_sha256(expected[0])
