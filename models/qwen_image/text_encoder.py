"""Qwen2.5-VL text encoder: prompt embeddings exactly as diffusers' QwenImagePipeline computes them.

Also the tiny, seeded Qwen2.5-VL the project embeds as its default model, and a checkpoint loader
that turns every loading problem into one CheckpointError.
"""

import hashlib
import logging
import math
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import DEFAULT_SEQUENCE_LENGTH, MAX_SEQUENCE_LENGTH
from qwen_image_fusion.models.loading import load_pretrained_model
from qwen_image_fusion.models.qwen_image.prompt_template import DROP_TOKENS, PROMPT_TEMPLATE

LOG = logging.getLogger("qwen_image")
VOCAB_SIZE = 152064  # Qwen2.5-VL-7B (the 3B model has 151936)
INIT_STD = 0.02
TOKEN_BUCKET = 64  # a batched text-encoder call's tokens: the next multiple above each prompt's own count


@torch.no_grad()
def encode_prompts(
    text_encoder: Qwen2_5_VLForConditionalGeneration,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    device: torch.device | str,
    dtype: torch.dtype,
    max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt embeddings [B, L, hidden] and their long mask [B, L] (None when every token is valid).

    Same ops as diffusers' `QwenImagePipeline.encode_prompt(prompts, device, 1, max_sequence_length=...)`,
    so the result is bit-identical; only the unused logits are skipped (`logits_to_keep=1`).
    """
    texts = templated(prompts, max_sequence_length)
    tokens = tokenizer(
        texts,
        max_length=MAX_SEQUENCE_LENGTH + DROP_TOKENS,
        padding=True,
        truncation=True,
        return_tensors="pt",
    ).to(device)
    hidden = last_hidden_states(text_encoder, tokens.input_ids, tokens.attention_mask)
    warn_dropped_tokens(tokenizer, texts, tokens.attention_mask.sum(dim=1).tolist(), max_sequence_length)
    embeds, mask = padded_prompt_rows(hidden, tokens.attention_mask, DROP_TOKENS)
    embeds = embeds.to(dtype=dtype, device=device)[:, :max_sequence_length].contiguous()
    mask = mask[:, :max_sequence_length].contiguous()
    return embeds, None if mask.all() else mask


@torch.no_grad()
def encode_prompts_batched(
    text_encoder: Qwen2_5_VLForConditionalGeneration,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    rows: int,
    device: torch.device | str,
    dtype: torch.dtype,
    max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
) -> list[torch.Tensor]:
    """Each prompt's embeddings [1, L, hidden], L its own valid length (so no mask), from text-encoder calls
    of a fixed shape: `rows` rows by the prompt's `token_bucket`, one call per bucket (per `rows` prompts of
    it), the free rows copies of the call's first prompt.

    Why a prompt's bytes do not depend on the prompts it shares a call with: at a fixed (rows, tokens) shape
    every op of the encoder is row-independent. Its GEMMs reduce over features only and the library picks
    the kernel by shape; RMSNorm, RoPE and the elementwise ops work per token; attention is masked per row
    and head (every row ends in a pad token, so transformers always builds the padding mask and never takes
    its unmasked causal path); text position ids are the row's own. So a row depends on its own tokens and
    the shape, and the shape on its own token count, `rows` and `max_sequence_length`. Not on the result of
    `encode_prompts` for the prompt alone: that runs at another shape. Tokens past the `max_sequence_length`
    kept ones are cut before the call, not after it: the encoder is causal, so the kept rows mean the same.
    """
    texts = templated(prompts, max_sequence_length)
    ids = tokenizer(texts, max_length=max_sequence_length + DROP_TOKENS, truncation=True).input_ids
    counts = [len(each) for each in ids]
    warn_dropped_tokens(tokenizer, texts, counts, max_sequence_length)
    buckets: dict[int, list[int]] = {}
    for index, count in enumerate(counts):
        buckets.setdefault(token_bucket(count, max_sequence_length), []).append(index)
    embeds: dict[int, torch.Tensor] = {}
    for tokens, members in buckets.items():
        for start in range(0, len(members), rows):
            call = members[start : start + rows]
            batch = [ids[i] for i in call] + [ids[call[0]]] * (rows - len(call))
            padded = tokenizer.pad(
                {"input_ids": batch}, padding="max_length", max_length=tokens, return_tensors="pt"
            ).to(device)
            hidden = last_hidden_states(text_encoder, padded.input_ids, padded.attention_mask)
            mask = padded.attention_mask
            for row, index in enumerate(call):
                own, _ = padded_prompt_rows(hidden[row : row + 1], mask[row : row + 1], DROP_TOKENS)
                embeds[index] = own.to(dtype=dtype, device=device).contiguous()
    return [embeds[i] for i in range(len(prompts))]


def last_hidden_states(
    text_encoder: Qwen2_5_VLForConditionalGeneration, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The encoder's last hidden states [B, L, hidden] as diffusers reads them (`hidden_states[-1]`); only
    the unused logits are skipped (`logits_to_keep=1`)."""
    output = text_encoder(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1
    )
    return output.hidden_states[-1]


def token_bucket(tokens: int, max_sequence_length: int) -> int:
    """The token count of the batched call that encodes a templated prompt of `tokens` tokens (after
    truncation to `max_sequence_length` + the template's dropped ones): the next multiple of TOKEN_BUCKET
    strictly above it, at most one above the most a prompt keeps, so every row ends in a pad token."""
    return min((tokens // TOKEN_BUCKET + 1) * TOKEN_BUCKET, max_sequence_length + DROP_TOKENS + 1)


def templated(prompts: list[str], max_sequence_length: int) -> list[str]:
    """The prompts in Qwen-Image's template; InputError for none or a length outside 1..1024."""
    if not prompts:
        raise InputError("at least one prompt is needed")
    if not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise InputError(f"max_sequence_length must be 1..{MAX_SEQUENCE_LENGTH}, got {max_sequence_length}")
    return [PROMPT_TEMPLATE.format(prompt) for prompt in prompts]


def padded_prompt_rows(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor, drop: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's valid rows of the last hidden state without its first `drop` (template) tokens,
    right-padded with zeros to the longest: (embeds [B, L, hidden], long mask [B, L]), as diffusers'
    `_extract_masked_hidden` and the stacking after it."""
    valid = attention_mask.bool()
    rows = torch.split(hidden_states[valid], valid.sum(dim=1).tolist(), dim=0)
    rows = [row[drop:] for row in rows]
    lengths = torch.tensor([row.size(0) for row in rows], device=rows[0].device)
    longest = int(lengths.max())
    embeds = torch.stack(
        [torch.cat([row, row.new_zeros(longest - row.size(0), row.size(1))]) for row in rows]
    )
    return embeds, (torch.arange(longest, device=lengths.device) < lengths[:, None]).long()


def warn_dropped_tokens(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], encoded: list[int], max_sequence_length: int
) -> None:
    """Warn, per prompt, how many of its tokens the tokenizer's length limit or `max_sequence_length` cut off.

    `encoded` counts each templated prompt's tokens after the tokenizer's truncation; only prompts that
    reached a limit are tokenized again, without truncation, to count what was lost.
    """
    limit = min(MAX_SEQUENCE_LENGTH, max_sequence_length)
    for i, (text, count) in enumerate(zip(texts, encoded, strict=True)):
        if count - DROP_TOKENS < limit:
            continue
        total = len(tokenizer(text, truncation=False).input_ids) - DROP_TOKENS
        if total <= limit:
            continue
        LOG.warning(
            "prompt %d is %d tokens with the template's end: the %d past max_sequence_length %d were dropped",
            i + 1,
            total,
            total - limit,
            limit,
        )


def tiny_text_encoder_config(hidden_size: int = 64, num_layers: int = 2) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL-7B's architecture at toy sizes: 4 heads, 2 KV heads, real vocab, 1-block vision tower."""
    if hidden_size % 32:
        raise ValueError(f"hidden_size must be a multiple of 32, got {hidden_size}")
    rotary_pairs = hidden_size // 8  # head_dim / 2 with 4 heads
    temporal = rotary_pairs // 4  # Qwen2.5-VL-7B splits its 64 pairs 16/24/24 (t/h/w)
    height = (rotary_pairs - temporal) // 2
    text_config = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128000,
        "max_window_layers": num_layers,
        "rms_norm_eps": 1e-6,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [temporal, height, rotary_pairs - temporal - height],
        },
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": hidden_size,
        "fullatt_block_indexes": [0],
        "tokens_per_second": 2,
    }
    return Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False)


QWEN25_VL_7B = {  # Qwen2.5-VL-7B's language model: the full-size stand-ins of the benchmarks and tests
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_window_layers": 28,
}


QWEN25_VL_7B_VISION = {  # Qwen2.5-VL-7B-Instruct's vision tower (config.json's vision_config)
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "window_size": 112,
    "tokens_per_second": 2,
}


def qwen25_vl_7b_config(vision: bool = False) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL-7B's language model at its real sizes, with the toy vision tower (text prompts never use
    it) or, with `vision`, the real one (an Edit model's encoder sees the input images)."""
    config = tiny_text_encoder_config(hidden_size=3584, num_layers=28)
    for key, value in QWEN25_VL_7B.items():
        setattr(config.text_config, key, value)
    config.text_config.rope_parameters["mrope_section"] = [16, 24, 24]
    if vision:
        for key, value in QWEN25_VL_7B_VISION.items():
            setattr(config.vision_config, key, value)
    return config


def build_tiny_text_encoder(seed: int, hidden_size: int = 64) -> Qwen2_5_VLForConditionalGeneration:
    """The tiny encoder with weights that depend only on (seed, parameter name): same on every machine.

    Norm weights are ones; every other tensor is uniform with std 0.02, drawn in float64 from a generator
    seeded per parameter (integer RNG and exact scaling, so no platform-specific math is involved).
    """
    model = Qwen2_5_VLForConditionalGeneration(tiny_text_encoder_config(hidden_size))
    bound = INIT_STD * math.sqrt(3.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.fill_(1.0)
                continue
            digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            values = torch.rand(param.shape, generator=generator, dtype=torch.float64)
            param.copy_(values.mul_(2.0).sub_(1.0).mul_(bound))
    return model.eval()


def load_text_encoder(
    directory: Path, dtype: torch.dtype, device: torch.device | str
) -> Qwen2_5_VLForConditionalGeneration:
    """A Qwen2.5-VL text encoder from a local folder (config.json + safetensors), every weight required."""
    return load_pretrained_model(directory, Qwen2_5_VLForConditionalGeneration, dtype, device, "text encoder")
