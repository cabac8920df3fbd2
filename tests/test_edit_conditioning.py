"""Edit conditioning (models/qwen_image_edit/conditioning.py) against diffusers' own QwenImageEditPipeline and
QwenImageEditPlusPipeline on tiny checkpoints loaded by their `from_pretrained`: the prompt embeddings and
masks, the packed reference latents and `img_shapes` that diffusers' pipeline hands its transformer are
bit-identical (torch.equal) to ours, for one to three images of odd sizes, RGBA and palette inputs, true
CFG on and off, fp32 and bf16."""

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from edit_fixtures import (
    SMALL_CONDITION_AREA,
    SMALL_VAE_AREA,
    build_edit_checkpoint,
    diffusers_edit_pipeline,
    drawn_image,
    small_edit_areas,
    transformer_calls,
)
from transformers import Qwen2VLProcessor

from qwen_image_fusion.models.errors import CheckpointError, InputError
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer
from qwen_image_fusion.models.qwen_image_edit.conditioning import (
    EDIT_DROP_TOKENS,
    EDIT_TEMPLATE,
    PLUS_TEMPLATE,
    SYSTEM_PROMPT,
    encode_edit_prompts,
    encode_reference_latents,
    load_edit_image,
    load_processor,
    prepare_edit_images,
)
from qwen_image_fusion.models.qwen_image_edit.config import (
    CONDITION_AREA,
    EDIT_KINDS,
    VAE_AREA,
    calculate_dimensions,
    check_processor_fits,
)
from qwen_image_fusion.models.vl_processor import torchvision_available

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Edit (no zero_cond_t) and Edit-2511-like Plus (zero_cond_t) checkpoints."""
    root = tmp_path_factory.mktemp("edit")
    return {
        "QwenImageEditPipeline": build_edit_checkpoint(root / "edit", "QwenImageEditPipeline", False, seed=1),
        "QwenImageEditPlusPipeline": build_edit_checkpoint(
            root / "plus", "QwenImageEditPlusPipeline", True, seed=2
        ),
    }


class Pipes(dict):
    """diffusers' pipelines by (class name, dtype), loaded on first use."""

    def __init__(self, checkpoints: dict[str, Path]) -> None:
        super().__init__()
        self.checkpoints = checkpoints

    def __missing__(self, key: tuple[str, torch.dtype]) -> object:
        self[key] = diffusers_edit_pipeline(self.checkpoints[key[0]], key[1])
        return self[key]


@pytest.fixture(scope="module")
def pipes(checkpoints: dict[str, Path]) -> Pipes:
    return Pipes(checkpoints)


def test_constants_match_diffusers() -> None:
    edit = QwenImageEditPipeline(None, None, None, None, None, None)
    plus = QwenImageEditPlusPipeline(None, None, None, None, None, None)
    assert edit.prompt_template_encode == EDIT_TEMPLATE and plus.prompt_template_encode == PLUS_TEMPLATE
    assert EDIT_DROP_TOKENS == edit.prompt_template_encode_start_idx == plus.prompt_template_encode_start_idx
    assert (VAE_AREA, CONDITION_AREA) == (
        pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE,
        pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE,
    )
    # independent of diffusers: the dropped prefix is exactly the system part and "<|im_start|>user\n"
    assert len(build_qwen2_tokenizer()(SYSTEM_PROMPT).input_ids) == EDIT_DROP_TOKENS


@pytest.mark.parametrize("area", [VAE_AREA, CONDITION_AREA, 12345])
def test_calculate_dimensions_matches_diffusers(area: int) -> None:
    for ratio in [0.25, 9 / 16, 0.7, 1.0, 4 / 3, 1.5, 1.77, 2.9, 75 / 53]:
        want = pipeline_qwenimage_edit_plus.calculate_dimensions(area, ratio)
        assert (
            calculate_dimensions(area, ratio)
            == want
            == pipeline_qwenimage_edit.calculate_dimensions(area, ratio)[:2]
        )
        width, height = want
        assert width % 32 == 0 and height % 32 == 0


@dataclass(frozen=True)
class Case:
    pipeline: str
    images: tuple[tuple[int, int, int, str], ...]  # (width, height, seed, PIL mode)
    prompt: str
    negative: str | None
    size: tuple[int, int] = (48, 32)
    dtype: torch.dtype = field(default=torch.float32)


CASES = {
    "edit, odd image, true CFG": Case(
        "QwenImageEditPipeline", ((75, 53, 1, "RGB"),), "make the sky red", " "
    ),
    "edit, RGBA, bf16": Case(
        "QwenImageEditPipeline", ((61, 90, 2, "RGBA"),), "一只猫", None, (32, 48), torch.bfloat16
    ),
    "plus, one image, true CFG": Case(
        "QwenImageEditPlusPipeline", ((83, 47, 3, "RGB"),), "add a hat", "blurry"
    ),
    "plus, two images, palette": Case(
        "QwenImageEditPlusPipeline", ((50, 70, 4, "P"), (99, 41, 5, "RGB")), "put 1 beside 2", " ", (64, 32)
    ),
    "plus, three images, RGBA, bf16": Case(
        "QwenImageEditPlusPipeline",
        ((40, 40, 6, "RGBA"), (77, 51, 7, "RGB"), (33, 95, 8, "P")),
        "the cat from picture 1 sits on the sofa of picture 2 under the lamp of picture 3",
        "low quality",
        (32, 32),
        torch.bfloat16,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_transformer_inputs_equal_diffusers_pipeline(pipes, name: str) -> None:
    """diffusers' pipeline runs end to end (the oracle); what it gives its transformer on the first step
    (and the negative branch) equals our conditioning bit for bit."""
    case = CASES[name]
    pipe = pipes[(case.pipeline, case.dtype)]
    kind = EDIT_KINDS[case.pipeline]
    images = [load_edit_image(drawn_image(*spec)) for spec in case.images]
    width, height = case.size
    with small_edit_areas(), transformer_calls(pipe) as calls:
        result = pipe(
            image=images if kind.plus else images[0],
            prompt=case.prompt,
            negative_prompt=case.negative,
            true_cfg_scale=4.0,
            width=width,
            height=height,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
        ).images[0]
    assert len(calls) == 2 * (2 if case.negative else 1)
    assert result.size == (width, height) and np.asarray(result).std() > 0

    prepared = prepare_edit_images(images, kind, pipe.vae_scale_factor, SMALL_VAE_AREA, SMALL_CONDITION_AREA)
    references, grids = encode_reference_latents(pipe.vae, prepared.pixels, 1, CPU, case.dtype)
    target = (1, height // 16, width // 16)
    prompts = [case.prompt] + ([case.negative] if case.negative else [])
    for prompt, call in zip(prompts, calls, strict=False):
        embeds, mask = encode_edit_prompts(
            pipe.text_encoder, pipe.processor, [prompt], prepared.condition, kind, CPU, case.dtype
        )
        assert embeds.dtype == call["encoder_hidden_states"].dtype == case.dtype
        assert torch.equal(embeds, call["encoder_hidden_states"])
        assert mask is None and call["encoder_hidden_states_mask"] is None
        assert call["img_shapes"] == [[target, *grids]]
        assert torch.equal(references, call["hidden_states"][:, target[1] * target[2] :])
    assert len(grids) == len(images) and references.shape[1] == sum(g[1] * g[2] for g in grids)


def test_prompt_batch_with_padding_equals_diffusers_encode_prompt(pipes) -> None:
    """Edit encodes one image per prompt: a padded batch of two prompts and two images, against
    diffusers' `encode_prompt` (its `__call__` with one image cannot take a prompt batch)."""
    pipe = pipes[("QwenImageEditPipeline", torch.float32)]
    kind = EDIT_KINDS["QwenImageEditPipeline"]
    images = [load_edit_image(drawn_image(64, 64, 9)), load_edit_image(drawn_image(48, 80, 10))]
    prompts = ["red", "turn the whole scene into a watercolour painting with soft edges"]
    embeds, mask = encode_edit_prompts(
        pipe.text_encoder, pipe.processor, prompts, images, kind, CPU, torch.float32
    )
    with torch.no_grad():
        want_embeds, want_mask = pipe.encode_prompt(prompts, image=images, device=CPU)
    assert torch.equal(embeds, want_embeds) and torch.equal(mask, want_mask)
    assert mask.dtype == torch.long and mask[0].sum() < mask[1].sum() == mask.shape[1]


def test_one_plus_prompt_per_call_and_one_edit_image_per_prompt(pipes) -> None:
    pipe = pipes[("QwenImageEditPipeline", torch.float32)]
    image = load_edit_image(drawn_image(32, 32, 11))
    args = (pipe.text_encoder, pipe.processor)
    with pytest.raises(InputError, match="one prompt per call"):
        encode_edit_prompts(
            *args, ["a", "b"], [image], EDIT_KINDS["QwenImageEditPlusPipeline"], CPU, torch.float32
        )
    with pytest.raises(InputError, match="one image per prompt"):
        encode_edit_prompts(
            *args, ["a", "b"], [image], EDIT_KINDS["QwenImageEditPipeline"], CPU, torch.float32
        )
    with pytest.raises(InputError, match="takes one input image"):
        prepare_edit_images([image, image], EDIT_KINDS["QwenImageEditPipeline"], 8)


@pytest.mark.parametrize("mode", ["RGBA", "P"])
def test_diffusers_fails_on_raw_rgba_and_palette_images(pipes, mode: str) -> None:
    """Why `load_edit_image` converts to RGB first, as diffusers' `load_image` does: given directly, such
    an image reaches the VAE with 4 or 1 channels."""
    pipe = pipes[("QwenImageEditPlusPipeline", torch.float32)]
    with small_edit_areas(), pytest.raises(RuntimeError, match="to have 3 channels"):
        pipe(image=[drawn_image(40, 30, 12, mode)], prompt="x", width=32, height=32, num_inference_steps=1)
    assert load_edit_image(drawn_image(40, 30, 12, mode)).mode == "RGB"


def test_exif_orientation_is_applied() -> None:
    image = drawn_image(40, 24, 13)
    exif = image.getexif()
    exif[0x0112] = 6  # rotated 90 degrees: the displayed image is 24 wide, 40 high
    rotated = PIL.Image.open(_png_with_exif(image, exif))
    assert load_edit_image(rotated).size == (24, 40)


def _png_with_exif(image: PIL.Image.Image, exif: PIL.Image.Exif):
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG", exif=exif)
    buffer.seek(0)
    return buffer


def test_reference_latents_repeat_over_the_batch(pipes) -> None:
    pipe = pipes[("QwenImageEditPlusPipeline", torch.float32)]
    kind = EDIT_KINDS["QwenImageEditPlusPipeline"]
    images = [load_edit_image(drawn_image(70, 40, 14)), load_edit_image(drawn_image(40, 70, 15))]
    prepared = prepare_edit_images(images, kind, 8, SMALL_VAE_AREA, SMALL_CONDITION_AREA)
    one, grids = encode_reference_latents(pipe.vae, prepared.pixels, 1, CPU, torch.float32)
    three, same_grids = encode_reference_latents(pipe.vae, prepared.pixels, 3, CPU, torch.float32)
    assert grids == same_grids and grids[0][1:] == grids[1][1:][::-1]
    assert three.shape == (3, *one.shape[1:]) and all(torch.equal(row, one[0]) for row in three)
    assert one.shape[-1] == 64


def test_processor_loads_without_torchvision(checkpoints: dict[str, Path]) -> None:
    """On this install (no torchvision) `auto` is the PIL backend; transformers' own `from_pretrained` of
    the folder, which diffusers' pipeline loading calls, fails there naming torchvision (so tests hand
    diffusers our processor)."""
    directory = checkpoints["QwenImageEditPlusPipeline"]
    processor = load_processor(directory / "processor", "pil")
    assert isinstance(processor, Qwen2VLProcessor) and processor.video_processor is None
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    if torchvision_available():
        pytest.skip("torchvision is installed: tests/gpu/test_edit_processor_gpu.py compares the backends")
    assert isinstance(load_processor(directory / "processor"), Qwen2VLProcessor)
    with pytest.raises(ImportError, match="Torchvision"):
        Qwen2VLProcessor.from_pretrained(directory / "processor")


def test_processor_problems_are_one_line(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"has no preprocessor_config\.json"):
        load_processor(tmp_path)
    with pytest.raises(ValueError, match="backend must be"):
        load_processor(checkpoints["QwenImageEditPipeline"] / "processor", "cuda")
    source = checkpoints["QwenImageEditPipeline"]
    check_processor_fits(source)
    broken = tmp_path / "broken"
    (broken / "processor").mkdir(parents=True)
    (broken / "text_encoder").mkdir()
    (broken / "text_encoder" / "config.json").write_text(
        (source / "text_encoder" / "config.json").read_text()
    )
    config = (source / "processor" / "preprocessor_config.json").read_text()
    (broken / "processor" / "preprocessor_config.json").write_text(
        config.replace('"patch_size": 14', '"patch_size": 16')
    )
    with pytest.raises(CheckpointError, match="processor patch_size 16 differs") as error:
        check_processor_fits(broken)
    assert "\n" not in str(error.value)
