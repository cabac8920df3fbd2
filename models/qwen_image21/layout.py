"""The joint token sequence of one Qwen-Image 2.1 request, worked out once on the host, and the prefix
key/value cache.

diffusers' `QwenImage21Transformer2DModel.forward` rebuilds this metadata on every call, with host syncs
(`tolist`, `nonzero`, boolean indexing). Here `build_layout` does it once per request: where text and image
rows go in the joint sequence, RoPE rotations, the modulation row of every token (the t = 0 row for the
prefix under `causal_condition`) and the attention calls of two passes:
- `full`: every token; the prefix attends block-causally (diffusers' `QwenImage21AttnProcessor`: one SDPA
  call per prefix segment over the keys before its end, text segments with a causal triangle), the target
  attends to everything;
- `target`: only the target image's rows, attending to the cached prefix keys and its own.
Both passes are plain data (device tensors and ints), so a step makes no host syncs and a target-only step
can be captured in a CUDA graph.
"""

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from qwen_image_fusion.kernels.scale_modulate import ModulationRows
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.qwen_image21.checkpoint import SLOT_TOKENS

ROPE_THETA = 10000
ROPE_POSITIVE, ROPE_NEGATIVE = 8192, 1024  # diffusers' `QwenImage21Rope` table sizes


def rope_tables(axes_dims: tuple[int, int, int], theta: int = ROPE_THETA) -> list[torch.Tensor]:
    """Per axis, complex64 rotations of positions 0..8191 then -1024..-1 (a negative index reads from the
    end), on the CPU: diffusers' `QwenImage21Rope.freqs`, computed with the same ops and shapes."""
    pos = torch.arange(ROPE_POSITIVE, device="cpu")
    neg = torch.arange(ROPE_NEGATIVE, device="cpu").flip(0) * -1 - 1

    def axis(index: torch.Tensor, dim: int) -> torch.Tensor:
        inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, device="cpu").to(torch.float32).div(dim))
        angles = torch.outer(index, inv)
        return torch.polar(torch.ones_like(angles), angles)

    return [torch.cat([axis(pos, dim), axis(neg, dim)], dim=0) for dim in axes_dims]


def rope_rotations(
    tables: list[torch.Tensor], img_shapes: list[tuple[int, int, int]], image_token: list[bool]
) -> torch.Tensor:
    """complex64 [S, head_dim/2] rotations of the joint sequence (diffusers' `QwenImage21Rope.forward`):
    text advances one position on all axes; an image block sits at one frame position after the text
    before it, on a height/width grid centred on zero, and advances the position by max(height, width)."""
    frame, image_h, image_w = [], [], []
    cursor = position = 0
    for _, height, width in img_shapes:
        start = image_token.index(True, cursor)
        frame.extend(range(position, position + start - cursor))
        position += start - cursor
        cursor = start + height * width
        frame.extend([position] * (height * width))
        position += max(height, width)
        image_h.extend(h for h in range(-(height - height // 2), height // 2) for _ in range(width))
        image_w.extend(w for _ in range(height) for w in range(-(width - width // 2), width // 2))
    frame.extend(range(position, position + len(image_token) - cursor))
    frame_index = torch.tensor(frame, dtype=torch.long)
    is_image = torch.tensor(image_token, dtype=torch.bool)
    height_index, width_index = frame_index.clone(), frame_index.clone()
    height_index[is_image] = torch.tensor(image_h, dtype=torch.long)
    width_index[is_image] = torch.tensor(image_w, dtype=torch.long)
    return torch.cat([tables[0][frame_index], tables[1][height_index], tables[2][width_index]], dim=-1)


class AttentionCall(NamedTuple):
    """One SDPA call: queries `[query_start, query_end)` of the pass's rows attend to keys `[0, key_end)` of
    the joint sequence, with `mask` (bool, broadcast to [B, 1, q, k]) or None."""

    query_start: int
    query_end: int
    key_end: int
    mask: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class PassPlan:
    """What one pass computes: joint rows `[start, S)`, their RoPE rows and modulation rows, the attention
    calls, and which of its rows are the target image (`output_start`) with their modulation rows."""

    start: int
    rope: torch.Tensor
    rows: ModulationRows
    calls: tuple[AttentionCall, ...]
    output_start: int
    output_rows: ModulationRows


@dataclass(frozen=True, eq=False)
class TokenLayout:
    """The joint sequence of one request (samples share it, as in diffusers): text rows, condition images,
    then the target image's `target_len` rows; built by `build_layout`."""

    batch: int
    text_len: int
    image_len: int
    seq_len: int
    target_len: int
    text_rows: torch.Tensor
    text_source: torch.Tensor
    image_rows: torch.Tensor
    full: PassPlan
    target: PassPlan

    @property
    def prefix_len(self) -> int:
        return self.seq_len - self.target_len


def _segments(image_ids: list[int], prefix_len: int) -> list[tuple[int, int, bool]]:
    """Runs of equal block id in the prefix, `(start, end, is_text)` (`_qwenimage21_prefix_segments`)."""
    segments, start = [], 0
    for index in range(1, prefix_len + 1):
        if index == prefix_len or image_ids[index] != image_ids[start]:
            segments.append((start, index, image_ids[start] < 0))
            start = index
    return segments


def _segment_mask(
    start: int, end: int, is_text: bool, key_valid: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """The SDPA mask of one prefix segment, built as diffusers' processor builds it (same shapes)."""
    mask = None
    if is_text:
        length = end - start
        mask = torch.cat(
            [
                torch.ones(length, start, dtype=torch.bool, device=device),
                torch.tril(torch.ones(length, length, dtype=torch.bool, device=device)),
            ],
            dim=1,
        )[None, None]
    if key_valid is not None:
        valid = key_valid[:, None, None, :end]
        mask = valid if mask is None else mask & valid
    return mask


def _modulation_rows(batch: int, rows: int, target_from: int, causal: bool, device) -> ModulationRows:
    """Per token of `rows` joint rows: its sample's row, or (causal, before `target_from`) the t = 0 row."""
    index = torch.arange(batch, dtype=torch.int32).view(batch, 1).repeat(1, rows)
    if causal:
        index[:, :target_from] = batch
    return ModulationRows(index.to(device), causal)


def target_pass(
    prefix_len: int, seq_len: int, rope: torch.Tensor, rows: ModulationRows, mask: torch.Tensor | None
) -> PassPlan:
    """The target-only pass: rows `[prefix_len, seq_len)` with their RoPE rows and modulation rows, one SDPA
    call over every key (`mask`: the padded text's key mask, broadcast [B, 1, 1, S], or None)."""
    return PassPlan(
        start=prefix_len,
        rope=rope,
        rows=rows,
        calls=(AttentionCall(0, seq_len - prefix_len, seq_len, mask),),
        output_start=0,
        output_rows=rows,
    )


def build_layout(
    img_mask: torch.Tensor,
    img_shapes: list[tuple[int, int, int]],
    text_mask: torch.Tensor | None,
    tables: list[torch.Tensor],
    causal: bool,
    device: torch.device,
) -> TokenLayout:
    """Work out a request's joint sequence once (host reads allowed here, never in a step).

    `img_mask` [B, L_vlm + T/4] marks the vision-language image slots, the target's T/4 slots last (as
    diffusers' pipeline appends them); `img_shapes` lists (frames, height, width) in latent tokens, condition
    images first and the target last; `text_mask` [B, L_vlm] marks valid text (None: no padding).
    """
    slots = img_mask[0].bool().cpu().tolist()
    image_token = [flag for slot in slots for flag in ([slot] * SLOT_TOKENS if slot else [slot])]
    lengths = [math.prod(shape) for shape in img_shapes]
    image_positions = [i for i, flag in enumerate(image_token) if flag]
    if not lengths or sum(lengths) != len(image_positions):
        raise InputError(
            f"img_shapes account for {sum(lengths)} image tokens but img_mask marks {len(image_positions)}"
        )
    seq_len, target_len = len(image_token), lengths[-1]
    if target_len % SLOT_TOKENS or not all(image_token[seq_len - target_len :]):
        raise InputError(f"the target image's {target_len} tokens must be whole slots closing img_mask")
    text_len = len(slots) - target_len // SLOT_TOKENS
    prefix_len = seq_len - target_len
    batch = img_mask.shape[0]

    image_ids = [-1] * seq_len
    block_ids = [block for block, length in enumerate(lengths) for _ in range(length)]
    for position, block in zip(image_positions, block_ids, strict=True):
        image_ids[position] = block
    text_rows = [i for i, flag in enumerate(image_token) if not flag]
    text_source = [j for j, slot in enumerate(slots) if not slot]

    key_valid = None
    if text_mask is not None:
        if tuple(text_mask.shape) != (batch, text_len):
            raise InputError(f"text mask has shape {list(text_mask.shape)}, expected {[batch, text_len]}")
        key_valid = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
        key_valid[:, text_rows] = text_mask.to(device).bool()[:, text_source]
    target_mask = None if key_valid is None else key_valid[:, None, None, :]

    rope = torch.view_as_real(rope_rotations(tables, img_shapes, image_token)).to(device)
    prefix_calls = [
        AttentionCall(start, end, end, _segment_mask(start, end, is_text, key_valid, device))
        for start, end, is_text in _segments(image_ids, prefix_len)
    ]
    full_rows = _modulation_rows(batch, seq_len, prefix_len, causal, device)
    target_rows = _modulation_rows(batch, target_len, 0, causal, device)
    full = PassPlan(
        start=0,
        rope=rope,
        rows=full_rows,
        calls=(*prefix_calls, AttentionCall(prefix_len, seq_len, seq_len, target_mask)),
        output_start=prefix_len,
        output_rows=ModulationRows(full_rows.index[:, prefix_len:].contiguous(), causal),
    )
    target = target_pass(prefix_len, seq_len, rope[prefix_len:], target_rows, target_mask)

    def on_device(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device)

    return TokenLayout(
        batch=batch,
        text_len=text_len,
        image_len=len(image_positions),
        seq_len=seq_len,
        target_len=target_len,
        text_rows=on_device(text_rows),
        text_source=on_device(text_source),
        image_rows=on_device(image_positions),
        full=full,
        target=target,
    )


class TransientKV:
    """Keys and values of a pass without a cache: fresh [B, S, H, D] buffers per block, freed after it."""

    def __init__(self, batch: int, seq_len: int, heads: int, head_dim: int, dtype, device) -> None:
        self.shape = (2, batch, seq_len, heads, head_dim)
        self.dtype, self.device = dtype, device

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        key, value = torch.empty(self.shape, dtype=self.dtype, device=self.device).unbind(0)
        return key, value


@dataclass(eq=False)
class PrefixKVCache:
    """Keys and values of every block for one request, [layers, 2, B, S, H, D], at fixed addresses.

    The full pass (first step) writes all rows; a target-only pass rewrites the target rows in place and
    attends over the whole buffer, so the prefix (text and condition images, modulated from t = 0 and so
    the same at every step) is computed once. No allocation per step: graph-capturable.
    """

    layout: TokenLayout
    buffers: torch.Tensor
    filled: bool = field(default=False)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffers[index, 0], self.buffers[index, 1]
