"""The Qwen2-VL processor's two image backends on the machine that has torchvision (the H200 box): does
transformers' torchvision backend (what `AutoProcessor` / diffusers' loading pick) give the same
`pixel_values` and `image_grid_thw` as the PIL backend (`Qwen2VLImageProcessorPil`, what a CPU install without
torchvision uses through `qwen_image_fusion.models.qwen_image_edit.conditioning.load_processor`)? Checked on
the fixture's processor folder for small, odd, large, RGBA- and palette-converted images and the Edit / Plus
prepared images; then diffusers' own `from_pretrained` (no processor handed in) against our embeddings with
the backend `load_processor` picks where torchvision is installed.

Measured on the H200 (2026-12-01, transformers 5.17, torchvision 0.26): the grids are identical, and 53-73%
of the pixel values differ by one or two of 255 levels (the two resize implementations round differently);
docs/DESIGN.md §8 states it. The tests hold that measurement: never more than two levels apart.
"""

import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from edit_fixtures import build_edit_checkpoint, drawn_image
from transformers import Qwen2VLProcessor

from qwen_image_fusion.models.qwen_image_edit.conditioning import (
    encode_edit_prompts,
    load_edit_image,
    load_processor,
    prepare_edit_images,
)
from qwen_image_fusion.models.qwen_image_edit.config import EDIT_KINDS
from qwen_image_fusion.models.vl_processor import torchvision_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torchvision_available(), reason="needs torchvision (the H200 box has it)"),
]
IMAGES = {
    "tiny 20x30": (20, 30, 1, "RGB"),
    "odd 75x53": (75, 53, 2, "RGB"),
    "portrait 333x517": (333, 517, 3, "RGB"),
    "large 1024x1024": (1024, 1024, 4, "RGB"),
    "wide 1664x928": (1664, 928, 5, "RGB"),
    "RGBA 301x199": (301, 199, 6, "RGBA"),
    "palette 257x255": (257, 255, 7, "P"),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_edit_checkpoint(tmp_path_factory.mktemp("edit"), "QwenImageEditPlusPipeline", True, seed=4)


@pytest.fixture(scope="module")
def backends(checkpoint) -> dict[str, Qwen2VLProcessor]:
    processors = {name: load_processor(checkpoint / "processor", name) for name in ("pil", "torchvision")}
    assert type(processors["torchvision"].image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(processors["pil"].image_processor).__name__ == "Qwen2VLImageProcessorPil"
    return processors


def compare(backends, images, tag: str) -> None:
    out = {
        name: processor.image_processor(images=images, return_tensors="pt")
        for name, processor in backends.items()
    }
    pil, tv = out["pil"], out["torchvision"]
    assert torch.equal(pil["image_grid_thw"], tv["image_grid_thw"]), tag
    diff = (pil["pixel_values"] - tv["pixel_values"]).abs()
    print(
        f"{tag}: {int((diff > 0).sum())} of {diff.numel()} pixel values differ, max {float(diff.max()):.3g}"
    )
    level = 1 / 255 / min(backends["pil"].image_processor.image_std)  # one 8-bit level after normalizing
    assert float(diff.max()) <= 2 * level + 1e-6, tag


@pytest.mark.parametrize("name", list(IMAGES))
def test_backends_are_at_most_two_levels_apart(backends, name):
    compare(backends, [load_edit_image(drawn_image(*IMAGES[name]))], name)


@pytest.mark.parametrize("pipeline", list(EDIT_KINDS))
def test_backends_agree_on_prepared_edit_images(backends, pipeline):
    images = [load_edit_image(drawn_image(*spec)) for spec in list(IMAGES.values())[1:4]]
    kind = EDIT_KINDS[pipeline]
    # at the pipelines' own areas: 1024x1024 (Edit), 384x384 (Plus)
    prepared = prepare_edit_images(images if kind.plus else images[:1], kind, 8)
    compare(backends, prepared.condition, pipeline)


def test_diffusers_loads_the_processor_itself_and_our_auto_backend_matches_it(checkpoint, backends):
    pipe = QwenImageEditPlusPipeline.from_pretrained(checkpoint)
    assert type(pipe.processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    kind = EDIT_KINDS["QwenImageEditPlusPipeline"]
    images = [
        load_edit_image(drawn_image(*IMAGES["odd 75x53"])),
        load_edit_image(drawn_image(*IMAGES["RGBA 301x199"])),
    ]
    condition = prepare_edit_images(images, kind, 8, 96 * 96, 64 * 64).condition
    with torch.no_grad():
        want, _ = pipe.encode_prompt("put them together", image=condition, device="cpu")
    auto = load_processor(checkpoint / "processor")  # torchvision where it is installed, as diffusers
    assert type(auto.image_processor) is type(pipe.processor.image_processor)
    got, _ = encode_edit_prompts(
        pipe.text_encoder, auto, ["put them together"], condition, kind, "cpu", torch.float32
    )
    assert torch.equal(got, want)
    pil, _ = encode_edit_prompts(
        pipe.text_encoder, backends["pil"], ["put them together"], condition, kind, "cpu", torch.float32
    )
    print(f"PIL backend embeddings vs diffusers': max |diff| {float((pil - want).abs().max()):.3g}")
