"""LoRA in reference mode against diffusers + PEFT: the same file loaded into diffusers'
`QwenImagePipeline.load_lora_weights` and into ours gives identical pixels, for every file layout, for
stacked LoRAs with scales, with the Lightning preset's scheduler, and after unloading (the base again)."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers import QwenImagePipeline as DiffusersQwenImagePipeline
from helpers import diffusers_twin
from lora_files import (
    block_modules,
    linear_shapes,
    metadata_config,
    random_factors,
    shared_pipeline,
    write_comfy,
    write_diffusers_with_metadata,
    write_kohya,
    write_lightning,
    write_peft,
)

from qwen_image_fusion.models.lora import LoraLinear, lora_layers
from qwen_image_fusion.models.qwen_image.presets import LIGHTNING_SCHEDULER
from qwen_image_fusion.pipelines import load_pipeline

ARGS = dict(width=48, height=32, num_inference_steps=2, true_cfg_scale=4.0)
PROMPT, NEGATIVE, SEED = "a red fox in the snow", "blurry", 7


@pytest.fixture(scope="module")
def ours():
    pipe = load_pipeline(variant="reference", device="cpu")
    pipe.base_state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.base_image = _ours(pipe)
    return pipe


@pytest.fixture
def pipe(ours):
    yield from shared_pipeline(ours, "reference")


def _ours(pipe, **kwargs) -> np.ndarray:
    args = ARGS | kwargs
    negative = args.pop("negative", NEGATIVE)
    return np.asarray(pipe.generate(PROMPT, negative_prompt=negative, seed=SEED, **args)[0])


def _diffusers(ours, scheduler=None):
    return diffusers_twin(ours, DiffusersQwenImagePipeline, ours.base_state, scheduler)


def _theirs(theirs, **kwargs) -> np.ndarray:
    args = ARGS | kwargs
    negative = args.pop("negative", NEGATIVE)
    generator = torch.Generator("cpu").manual_seed(SEED)
    image = theirs(PROMPT, negative_prompt=negative, generator=generator, max_sequence_length=512, **args)
    return np.asarray(image.images[0])


def _lora_file(kind: str, ours, tmp_path):
    """A random LoRA file of one layout; ranks 4 to 16, some layers only, alpha below or above the rank."""
    shapes = linear_shapes(ours.transformer)
    layers = ours.transformer.config.num_layers
    if kind == "peft":
        modules = block_modules(layers, ("attn.to_q", "attn.to_v", "attn.to_add_out", "img_mlp.net.2"))
        return write_peft(tmp_path / "peft.safetensors", random_factors(shapes, modules, 4, seed=1))
    if kind == "peft-metadata":
        modules = [*block_modules(layers, ("attn.to_q", "attn.to_k", "txt_mlp.net.0.proj")), "proj_out"]
        ranks = {m: 8 if m.endswith("to_k") else 4 for m in modules}
        config = metadata_config(modules, 4, 8, rank_pattern={"to_k": 8}, alpha_pattern={"to_k": 2})
        return write_diffusers_with_metadata(tmp_path, random_factors(shapes, modules, ranks, seed=2), config)
    if kind == "kohya":
        modules = block_modules(1, ("attn.add_k_proj", "attn.to_out.0", "img_mlp.net.0.proj", "txt_mod.1"))
        modules += ["norm_out.linear", "time_text_embed.timestep_embedder.linear_1"]
        return write_kohya(tmp_path / "kohya.safetensors", random_factors(shapes, modules, 8, seed=3), 4.0)
    if kind == "comfyui":
        modules = block_modules(layers, ("attn.add_v_proj", "txt_mlp.net.2", "img_mod.1"))
        return write_comfy(tmp_path / "comfy.safetensors", random_factors(shapes, modules, 4, seed=4), 6.0)
    if kind == "lightning":
        factors = random_factors(shapes, block_modules(layers), 16, seed=5, std=0.2, dtype=torch.bfloat16)
        return write_lightning(tmp_path / "Qwen-Image-Lightning-4steps-test.safetensors", factors, 2.0)
    raise ValueError(kind)


@pytest.mark.cpu_dtype
@pytest.mark.parametrize("kind", ["peft", "peft-metadata", "kohya", "comfyui", "lightning"])
def test_each_layout_matches_diffusers_pixel_for_pixel(pipe, tmp_path, kind):
    path = _lora_file(kind, pipe, tmp_path)
    name = pipe.load_lora(path)
    got = _ours(pipe)
    theirs = _diffusers(pipe)
    theirs.load_lora_weights(str(path), adapter_name="a")
    expected = _theirs(theirs)
    assert np.array_equal(got, expected)
    assert not np.array_equal(got, pipe.base_image), "the LoRA must change the image"
    assert all(isinstance(m, LoraLinear) for m in lora_layers(pipe.transformer).values())
    assert pipe.loras[name].layers == len(lora_layers(pipe.transformer))


def test_stacked_scaled_switched_and_unloaded_loras_match_diffusers(pipe, tmp_path):
    style, fast = _lora_file("kohya", pipe, tmp_path), _lora_file("lightning", pipe, tmp_path)
    pipe.load_lora(style, scale=0.8, name="style")
    pipe.load_lora(fast, scale=-0.5, name="fast")
    theirs = _diffusers(pipe)
    theirs.load_lora_weights(str(style), adapter_name="style")
    theirs.load_lora_weights(str(fast), adapter_name="fast")
    theirs.set_adapters(["style", "fast"], [0.8, -0.5])
    assert np.array_equal(_ours(pipe), _theirs(theirs))

    pipe.set_lora_scales({"style": 0.3, "fast": 1.25})  # switched at run time, nothing reloaded
    theirs.set_adapters(["style", "fast"], [0.3, 1.25])
    stacked = _ours(pipe)
    assert np.array_equal(stacked, _theirs(theirs))

    pipe.unload_lora("style")
    theirs.delete_adapters("style")
    theirs.set_adapters(["fast"], [1.25])
    assert np.array_equal(_ours(pipe), _theirs(theirs))
    pipe.unload_lora()
    assert not lora_layers(pipe.transformer) and not pipe.loras
    assert np.array_equal(_ours(pipe), pipe.base_image)
    state = pipe.transformer.state_dict()
    assert state.keys() == pipe.base_state.keys()
    assert all(torch.equal(state[k], v) for k, v in pipe.base_state.items())


def test_lightning_preset_matches_diffusers_with_the_release_scheduler(pipe, tmp_path):
    path = _lora_file("lightning", pipe, tmp_path)
    pipe.load_lora(path)
    run = dict(num_inference_steps=None, true_cfg_scale=None, negative=" ")
    got = _ours(pipe, preset="lightning-4", **run)
    assert (pipe.last_run.num_inference_steps, pipe.last_run.preset) == (4, "lightning-4")
    theirs = _diffusers(pipe, FlowMatchEulerDiscreteScheduler.from_config(LIGHTNING_SCHEDULER))
    theirs.load_lora_weights(str(path))
    assert np.array_equal(got, _theirs(theirs, num_inference_steps=4, true_cfg_scale=1.0, negative=" "))
    default_scheduler = _ours(pipe, num_inference_steps=4, true_cfg_scale=1.0, negative=" ")
    assert not np.array_equal(got, default_scheduler), "the preset must change the schedule"
