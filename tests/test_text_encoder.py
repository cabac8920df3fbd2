"""Prompt encoding, bit for bit against diffusers' QwenImagePipeline, and the tiny encoder and its loader."""

import json
import re
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from qwen_image_fusion.models.errors import CheckpointError, InputError
from qwen_image_fusion.models.qwen_image.text_encoder import (
    DROP_TOKENS,
    MAX_SEQUENCE_LENGTH,
    PROMPT_TEMPLATE,
    build_tiny_text_encoder,
    encode_prompts,
    load_text_encoder,
    tiny_text_encoder_config,
)
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer

CPU = torch.device("cpu")
LONG = "A red apple on a wooden table next to a glass of water, soft morning light, shallow depth of field"


@pytest.fixture(scope="module")
def tokenizer() -> Qwen2Tokenizer:
    return build_qwen2_tokenizer()


@pytest.fixture(scope="module")
def encoder() -> Qwen2_5_VLForConditionalGeneration:
    return build_tiny_text_encoder(seed=0)


@pytest.fixture(scope="module")
def pipe(encoder: Qwen2_5_VLForConditionalGeneration, tokenizer: Qwen2Tokenizer) -> QwenImagePipeline:
    scheduler = FlowMatchEulerDiscreteScheduler()
    return QwenImagePipeline(scheduler, vae=None, text_encoder=encoder, tokenizer=tokenizer, transformer=None)


def test_constants_match_diffusers(pipe: QwenImagePipeline) -> None:
    assert pipe.prompt_template_encode == PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == DROP_TOKENS
    assert pipe.tokenizer_max_length == MAX_SEQUENCE_LENGTH


@pytest.mark.parametrize(
    ("prompts", "max_sequence_length"),
    [
        (["a cat"], 512),
        (["a cat", LONG], 512),
        (["一只橘猫坐在窗台上，阳光洒在它的毛发上。", "a cat 🐱"], 512),
        ([LONG, "a cat"], 5),  # both rows keep 5 tokens: the mask becomes all ones -> None
        (["a cat", LONG], 8),  # "a cat" has 7 tokens after the prefix: one padded position survives
    ],
)
def test_bit_identical_to_diffusers(
    encoder: Qwen2_5_VLForConditionalGeneration,
    tokenizer: Qwen2Tokenizer,
    pipe: QwenImagePipeline,
    prompts: list[str],
    max_sequence_length: int,
) -> None:
    embeds, mask = encode_prompts(encoder, tokenizer, prompts, CPU, torch.float32, max_sequence_length)
    with torch.no_grad():
        ref_embeds, ref_mask = pipe.encode_prompt(prompts, CPU, 1, max_sequence_length=max_sequence_length)
    assert embeds.dtype == ref_embeds.dtype == torch.float32
    assert torch.equal(embeds, ref_embeds)
    assert (mask is None) == (ref_mask is None)
    if mask is not None:
        assert mask.dtype == ref_mask.dtype == torch.long
        assert torch.equal(mask, ref_mask)

    # Independent of diffusers: token counts after the template prefix, zero padding.
    counts = [len(tokenizer(PROMPT_TEMPLATE.format(p)).input_ids) - DROP_TOKENS for p in prompts]
    width = min(max(counts), max_sequence_length)
    assert embeds.shape == (len(prompts), width, encoder.config.text_config.hidden_size)
    expected_mask = torch.tensor([[int(j < n) for j in range(width)] for n in counts])
    if expected_mask.all():
        assert mask is None
    else:
        assert torch.equal(mask, expected_mask)
        assert not embeds[expected_mask == 0].any()
        assert embeds[expected_mask == 1].abs().sum(dim=-1).min() > 0


def test_single_prompt_has_no_mask(
    encoder: Qwen2_5_VLForConditionalGeneration, tokenizer: Qwen2Tokenizer
) -> None:
    embeds, mask = encode_prompts(encoder, tokenizer, ["a cat"], CPU, torch.float32)
    assert mask is None and embeds.shape == (1, 7, 64)  # a, Ġcat, <|im_end|>, Ċ, <|im_start|>, assistant, Ċ


def test_dtype_is_applied(
    encoder: Qwen2_5_VLForConditionalGeneration, tokenizer: Qwen2Tokenizer, pipe: QwenImagePipeline
) -> None:
    embeds, _ = encode_prompts(encoder, tokenizer, ["a cat", LONG], CPU, torch.bfloat16)
    with torch.no_grad():
        ref_embeds, _ = pipe.encode_prompt(["a cat", LONG], CPU, 1, max_sequence_length=512)
    assert embeds.dtype == torch.bfloat16
    assert torch.equal(embeds, ref_embeds.to(torch.bfloat16))


@pytest.mark.parametrize(("prompts", "length"), [([], 512), (["a"], 0), (["a"], MAX_SEQUENCE_LENGTH + 1)])
def test_invalid_arguments(
    encoder: Qwen2_5_VLForConditionalGeneration, tokenizer: Qwen2Tokenizer, prompts: list[str], length: int
) -> None:
    with pytest.raises(InputError):
        encode_prompts(encoder, tokenizer, prompts, CPU, torch.float32, length)


def test_tiny_config_is_valid_qwen2_5_vl() -> None:
    for hidden in (32, 64, 96):
        config = tiny_text_encoder_config(hidden)
        text = config.text_config
        head_dim = text.hidden_size // text.num_attention_heads
        assert config.model_type == "qwen2_5_vl" and text.vocab_size == 152064
        assert sum(text.rope_parameters["mrope_section"]) * 2 == head_dim
        assert config.vision_config.out_hidden_size == hidden
    with pytest.raises(ValueError, match="multiple of 32"):
        tiny_text_encoder_config(48)


def test_tiny_encoder_weights_are_pinned(encoder: Qwen2_5_VLForConditionalGeneration) -> None:
    """Same weights on every machine and call: values fixed from (seed, name) alone."""
    state = encoder.state_dict()
    embed = state["model.language_model.embed_tokens.weight"]
    assert embed.shape == (152064, 64)
    pinned = [-0.0013203852577134967, 0.018634924665093422, -0.009061857126653194]
    assert torch.equal(embed.flatten()[:3], torch.tensor(pinned))
    bias = state["model.language_model.layers.1.self_attn.q_proj.bias"]
    pinned = [-0.030758628621697426, 0.0042734271846711636, 0.028391210362315178]
    assert torch.equal(bias[:3], torch.tensor(pinned))
    assert abs(embed.std().item() - 0.02) < 1e-4
    assert torch.equal(state["model.language_model.norm.weight"], torch.ones(64))
    assert torch.equal(state["model.visual.merger.ln_q.weight"], torch.ones(32))
    assert not encoder.training


def test_tiny_encoder_is_deterministic(encoder: Qwen2_5_VLForConditionalGeneration) -> None:
    again = build_tiny_text_encoder(seed=0).state_dict()
    other = build_tiny_text_encoder(seed=1).state_dict()
    for name, value in encoder.state_dict().items():
        assert torch.equal(value, again[name]), name
    assert not torch.equal(
        other["model.language_model.embed_tokens.weight"],
        again["model.language_model.embed_tokens.weight"],
    )


@pytest.fixture(scope="module")
def saved_encoder(
    encoder: Qwen2_5_VLForConditionalGeneration, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    directory = tmp_path_factory.mktemp("text_encoder")
    encoder.save_pretrained(directory)
    return directory


def _link_all_but(source: Path, target: Path, name: str) -> Path:
    """A folder of symlinks to `source`'s files except `name`, which the test writes itself (or not)."""
    target.mkdir()
    for path in source.iterdir():
        if path.name != name:
            (target / path.name).symlink_to(path)
    return target


def test_save_load_round_trip(
    encoder: Qwen2_5_VLForConditionalGeneration, tokenizer: Qwen2Tokenizer, saved_encoder: Path
) -> None:
    loaded = load_text_encoder(saved_encoder, torch.float32, CPU)
    assert not loaded.training and loaded.dtype == torch.float32
    prompts = ["a cat", "一只猫 🐱"]
    expected = encode_prompts(encoder, tokenizer, prompts, CPU, torch.float32)
    actual = encode_prompts(loaded, tokenizer, prompts, CPU, torch.float32)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


def test_load_casts_dtype(saved_encoder: Path) -> None:
    loaded = load_text_encoder(saved_encoder, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())


def test_missing_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="folder not found"):
        load_text_encoder(tmp_path / "absent", torch.float32, CPU)


def test_missing_config_raises(saved_encoder: Path, tmp_path: Path) -> None:
    directory = _link_all_but(saved_encoder, tmp_path / "te", "config.json")
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_text_encoder(directory, torch.float32, CPU)


def test_invalid_config_raises(saved_encoder: Path, tmp_path: Path) -> None:
    directory = _link_all_but(saved_encoder, tmp_path / "te", "config.json")
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_text_encoder(directory, torch.float32, CPU)


def test_missing_weights_file_raises(saved_encoder: Path, tmp_path: Path) -> None:
    directory = _link_all_but(saved_encoder, tmp_path / "te", "model.safetensors")
    with pytest.raises(CheckpointError, match="cannot be loaded") as error:
        load_text_encoder(directory, torch.float32, CPU)
    assert "\n" not in str(error.value)


def test_missing_tensor_raises(saved_encoder: Path, tmp_path: Path) -> None:
    directory = _link_all_but(saved_encoder, tmp_path / "te", "model.safetensors")
    state = load_file(saved_encoder / "model.safetensors")
    norm = next(name for name in state if name.endswith("norm.weight") and "layers" not in name)
    del state[norm]
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks 1 weights, e\.g\. model\.language_model\.norm\.weight"):
        load_text_encoder(directory, torch.float32, CPU)


def test_incompatible_shapes_raise(saved_encoder: Path, tmp_path: Path) -> None:
    directory = _link_all_but(saved_encoder, tmp_path / "te", "config.json")
    config = json.loads((saved_encoder / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    example = "(6 tensors, e.g. model.language_model.layers.0.mlp.down_proj.weight is (64, 128), config wants"
    with pytest.raises(CheckpointError, match=re.escape(example)):
        load_text_encoder(directory, torch.float32, CPU)
