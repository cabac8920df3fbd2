"""LoRA on Qwen-Image 2.1 in reference mode against diffusers + PEFT: the same file loaded into diffusers'
`QwenImage21Pipeline.load_lora_weights` and into ours gives identical PNGs, for each file layout diffusers
reads (its Qwen-Image loader serves 2.1), on block and outside linears, stacked with scales; a kohya file
naming a module diffusers' key conversion cannot spell (`gate_layer`, `modulation.1`) is refused in one
line."""

import pytest
import torch
from edit_fixtures import drawn_image
from helpers import png_sha256
from lora_files import (
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
from qi21_checkpoints import RESOLUTION, build_qi21_checkpoint, diffusers_pipeline

from qwen_image_fusion.models.errors import QwenImageError
from qwen_image_fusion.pipelines import load_pipeline

LAYERS = 2
ARGS = dict(image=drawn_image(96, 64, seed=2, mode="RGBA"), negative_prompt="blurry", true_cfg_scale=3.0)
BLOCK = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "img_mlp.gate_layer",
    "img_mlp.proj",
    "img_mlp.out",
)
KOHYA_SPELLS = ("attn.to_q", "attn.to_out.0", "img_mlp.proj", "img_mlp.out")  # no underscore in the name


def blocks(names: tuple[str, ...]) -> list[str]:
    return [f"transformer_blocks.{i}.{name}" for i in range(LAYERS) for name in names]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    directory = build_qi21_checkpoint(tmp_path_factory.mktemp("qi21lora") / "ckpt")
    ours = load_pipeline(directory, variant="reference", device="cpu", dtype="fp32")
    ours.model.resolution = RESOLUTION
    return ours, diffusers_pipeline(directory)


@pytest.fixture
def pipes(both):
    ours, theirs = both
    for _ in shared_pipeline(ours, "reference"):
        yield ours, theirs
    theirs.unload_lora_weights()


def images(ours, theirs, **scales) -> tuple[str, str]:
    got = ours.generate("make it snow", seed=4, num_inference_steps=2, **ARGS)[0]
    generator = torch.Generator("cpu").manual_seed(4)
    want = theirs(
        "make it snow", generator=generator, num_inference_steps=2, output_resolution=RESOLUTION, **ARGS
    )
    return png_sha256(got), png_sha256(want.images[0])


def lora_file(kind: str, shapes, tmp_path):
    outside = ["img_in", "txt_in.in_layer", "modulation.1", "norm_out.linear", "proj_out"]
    if kind == "peft":
        return write_peft(
            tmp_path / "peft.safetensors", random_factors(shapes, blocks(BLOCK) + outside, 4, seed=1)
        )
    if kind == "peft-metadata":
        modules = blocks(("attn.to_q", "attn.to_k", "img_mlp.gate_layer"))
        ranks = {m: 8 if m.endswith("to_k") else 4 for m in modules}
        config = metadata_config(modules, 4, 8, rank_pattern={"to_k": 8}, alpha_pattern={"to_k": 2})
        return write_diffusers_with_metadata(tmp_path, random_factors(shapes, modules, ranks, seed=2), config)
    if kind == "kohya":
        factors = random_factors(shapes, [*blocks(KOHYA_SPELLS), "img_in", "proj_out"], 8, seed=3)
        return write_kohya(tmp_path / "kohya.safetensors", factors, 4.0)
    if kind == "comfyui":
        factors = random_factors(shapes, [*blocks(("attn.to_v", "img_mlp.out")), "modulation.1"], 4, seed=4)
        return write_comfy(tmp_path / "comfy.safetensors", factors, 6.0)
    factors = random_factors(shapes, blocks(BLOCK), 16, seed=5, std=0.2, dtype=torch.bfloat16)
    return write_lightning(tmp_path / "lightning.safetensors", factors, 2.0)


@pytest.mark.parametrize("kind", ["peft", "peft-metadata", "kohya", "comfyui", "lightning"])
def test_each_layout_matches_diffusers_png_for_png(pipes, tmp_path, kind):
    ours, theirs = pipes
    base = images(ours, theirs)[0]
    path = lora_file(kind, linear_shapes(ours.transformer), tmp_path)
    ours.load_lora(path)
    theirs.load_lora_weights(str(path), adapter_name="a")
    got, want = images(ours, theirs)
    assert got == want and got != base


def test_stacked_loras_with_scales_match_diffusers(pipes, tmp_path):
    ours, theirs = pipes
    shapes = linear_shapes(ours.transformer)
    style = write_peft(tmp_path / "style.safetensors", random_factors(shapes, blocks(BLOCK), 4, seed=6))
    fast = write_comfy(
        tmp_path / "fast.safetensors", random_factors(shapes, blocks(BLOCK[:4]), 8, seed=7), 4.0
    )
    ours.load_lora(style, scale=0.7, name="style")
    ours.load_lora(fast, scale=-0.4, name="fast")
    theirs.load_lora_weights(str(style), adapter_name="style")
    theirs.load_lora_weights(str(fast), adapter_name="fast")
    theirs.set_adapters(["style", "fast"], [0.7, -0.4])
    got, want = images(ours, theirs)
    assert got == want


def test_a_kohya_name_diffusers_cannot_spell_is_refused_in_one_line(pipes, tmp_path):
    ours, _ = pipes
    factors = random_factors(linear_shapes(ours.transformer), blocks(("img_mlp.gate_layer",)), 4, seed=8)
    path = write_kohya(tmp_path / "gate.safetensors", factors, 4.0)
    with pytest.raises(
        QwenImageError, match=r"img_mlp\.gate\.layer\.lora_A\.weight matches no linear layer"
    ) as err:
        ours.load_lora(path)
    assert "\n" not in str(err.value) and not ours.loras
