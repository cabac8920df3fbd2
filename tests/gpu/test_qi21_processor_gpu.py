"""Qwen3-VL's processor, two image backends, on the machine that has torchvision (the H200 box): does
transformers' torchvision backend (what `Qwen3VLProcessor.from_pretrained` and diffusers' loading pick) give
the same `pixel_values` and `image_grid_thw` as the PIL backend (`Qwen2VLImageProcessorPil`, what our CPU
install without torchvision uses through `models.vl_processor.load_vl_processor`)? Checked with Qwen3-VL's
own image-processor settings on the condition images 2.1 prepares (RGBA converted, resized to the 1024x1024
area, flattened over white) for several aspects, then on the prompt embeddings of the tiny text encoder, and
against diffusers' own `from_pretrained` (no processor handed in). Mismatch counts are printed (run with -s);
the answer goes into docs/DESIGN.md §10.
"""

import pytest
import torch
from diffusers import QwenImage21Pipeline
from diffusers.image_processor import VaeImageProcessor
from edit_fixtures import drawn_image
from qi21_checkpoints import build_qi21_checkpoint
from transformers import Qwen3VLProcessor

from models.qwen_image21 import synthetic
from models.qwen_image21.components import save_processor
from models.qwen_image21.conditioning import (
    encode_prompts21,
    flatten_alpha,
    prepare_condition_images,
    system_tokens,
)
from models.vl_processor import load_vl_processor, torchvision_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torchvision_available(), reason="needs torchvision (the H200 box has it)"),
]
IMAGES = {
    "square RGB 512x512": (512, 512, 1, "RGB"),
    "odd 75x53": (75, 53, 2, "RGB"),
    "portrait 333x517": (333, 517, 3, "RGB"),
    "wide 1664x928": (1664, 928, 4, "RGB"),
    "RGBA 301x199": (301, 199, 5, "RGBA"),
    "palette 257x255": (257, 255, 6, "P"),
}
RESOLUTION = 1024  # diffusers' default output_resolution: the condition images' area


@pytest.fixture(scope="module")
def backends(tmp_path_factory) -> dict[str, Qwen3VLProcessor]:
    """Qwen3-VL's image-processor settings saved as a checkpoint's processor/ folder, loaded both ways."""
    folder = tmp_path_factory.mktemp("qwen3vl") / "processor"
    save_processor(synthetic.processor(), folder)
    processors = {name: load_vl_processor(folder, Qwen3VLProcessor, name) for name in ("pil", "torchvision")}
    assert type(processors["torchvision"].image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(processors["pil"].image_processor).__name__ == "Qwen2VLImageProcessorPil"
    return processors


def condition(name: str, resolution: int = RESOLUTION):
    """The image as 2.1 hands it to the vision tower: RGBA, resized to the condition area, over white."""
    prepared = prepare_condition_images([drawn_image(*IMAGES[name])], resolution, VaeImageProcessor(16))
    return flatten_alpha(prepared.vision[0])


@pytest.mark.parametrize("name", list(IMAGES))
def test_backends_give_the_same_pixel_values(backends, name):
    out = {
        key: p.image_processor(images=[condition(name)], return_tensors="pt") for key, p in backends.items()
    }
    pil, tv = out["pil"], out["torchvision"]
    assert torch.equal(pil["image_grid_thw"], tv["image_grid_thw"]), name
    diff = (pil["pixel_values"] - tv["pixel_values"]).abs()
    print(
        f"{name}: {int((diff > 0).sum())} of {diff.numel()} pixel values differ, max {float(diff.max()):.3g}"
    )
    assert torch.equal(pil["pixel_values"], tv["pixel_values"]), name


def test_backends_give_the_same_prompt_embeddings(tmp_path):
    """The whole encode (prompt template, vision tokens, the tiny Qwen3-VL) with each backend, at the tests'
    64x64 condition area; then diffusers' pipeline loading its processor itself (torchvision)."""
    directory = build_qi21_checkpoint(tmp_path / "ckpt")
    pipe = QwenImage21Pipeline.from_pretrained(directory)
    assert type(pipe.processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    vision = [condition("portrait 333x517", 64), condition("RGBA 301x199", 64)]
    pil = load_vl_processor(directory / "processor", Qwen3VLProcessor, "pil")
    with torch.no_grad():
        want, _, _ = pipe.encode_prompt(["make it snow"], image=vision, device="cpu")
    got = encode_prompts21(
        pipe.text_encoder, pil, ["make it snow"], vision, system_tokens(pil), "cpu", want.dtype
    )
    assert torch.equal(got[0], want)
