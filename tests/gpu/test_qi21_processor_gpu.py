"""Qwen3-VL's processor, two image backends, on the machine that has torchvision (the H200 box): does
transformers' torchvision backend (what `Qwen3VLProcessor.from_pretrained` and diffusers' loading pick) give
the `pixel_values` and `image_grid_thw` of the PIL backend (`Qwen2VLImageProcessorPil`, what our CPU install
without torchvision uses through `qwen_image_fusion.models.vl_processor.load_vl_processor`)? Checked with
Qwen3-VL's own image-processor settings on the condition images 2.1 prepares (RGBA converted, resized to the
1024x1024 area, flattened over white) for several aspects; then the prompt embeddings of the tiny text encoder
with the backend `load_vl_processor` picks where torchvision is installed, against diffusers' own
`from_pretrained` (no processor handed in). Qwen3-VL resizes with Qwen2-VL's image processors, which the H200
measured for the Edit family (docs/DESIGN.md §8): identical grids, pixel values one or two of 255 levels
apart; the tests hold that and print the counts (run with -s). The answer goes into DESIGN §11.
"""

import pytest
import torch
from diffusers import QwenImage21Pipeline
from diffusers.image_processor import VaeImageProcessor
from edit_fixtures import drawn_image
from qi21_checkpoints import build_qi21_checkpoint
from transformers import Qwen3VLProcessor

from qwen_image_fusion.models.qwen_image21 import synthetic
from qwen_image_fusion.models.qwen_image21.components import save_processor
from qwen_image_fusion.models.qwen_image21.conditioning import (
    encode_prompts21,
    flatten_alpha,
    prepare_condition_images,
    system_tokens,
)
from qwen_image_fusion.models.vl_processor import load_vl_processor, torchvision_available

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
def test_backends_are_at_most_two_levels_apart(backends, name):
    out = {
        key: p.image_processor(images=[condition(name)], return_tensors="pt") for key, p in backends.items()
    }
    pil, tv = out["pil"], out["torchvision"]
    assert torch.equal(pil["image_grid_thw"], tv["image_grid_thw"]), name
    diff = (pil["pixel_values"] - tv["pixel_values"]).abs()
    print(
        f"{name}: {int((diff > 0).sum())} of {diff.numel()} pixel values differ, max {float(diff.max()):.3g}"
    )
    level = 1 / 255 / min(backends["pil"].image_processor.image_std)  # one 8-bit level after normalizing
    assert float(diff.max()) <= 2 * level + 1e-6, name


def test_our_auto_backend_gives_diffusers_embeddings(tmp_path):
    """The whole encode (prompt template, vision tokens, the tiny Qwen3-VL) at the tests' 64x64 condition
    area: with the backend we pick where torchvision is installed it equals diffusers' pipeline loading its
    processor itself, bit for bit; the PIL backend's distance is printed."""
    directory = build_qi21_checkpoint(tmp_path / "ckpt")
    pipe = QwenImage21Pipeline.from_pretrained(directory)
    assert type(pipe.processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    vision = [condition("portrait 333x517", 64), condition("RGBA 301x199", 64)]
    with torch.no_grad():
        want, _, _ = pipe.encode_prompt(["make it snow"], image=vision, device="cpu")
    for backend in ("auto", "pil"):
        processor = load_vl_processor(directory / "processor", Qwen3VLProcessor, backend)
        drop = system_tokens(processor)
        got = encode_prompts21(
            pipe.text_encoder, processor, ["make it snow"], vision, drop, "cpu", want.dtype
        )[0]
        if backend == "auto":
            assert type(processor.image_processor) is type(pipe.processor.image_processor)
            assert torch.equal(got, want)
        else:
            print(f"PIL backend embeddings vs diffusers': max |diff| {float((got - want).abs().max()):.3g}")
