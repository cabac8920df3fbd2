"""Plain functions of the Qwen-Image transformer: timestep embedding, RoPE tables, attention.

Each mirrors diffusers' arithmetic exactly (same ops, same dtypes), which the oracle tests check.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from qwen_image_fusion.models.sequence_parallel import active_shards

ROPE_THETA = 10000
ROPE_TABLE_LENGTH = 4096


def timestep_embedding(timesteps: torch.Tensor, channels: int = 256, scale: float = 1000.0) -> torch.Tensor:
    """Sinusoidal embedding, cos first (flip_sin_to_cos, shift 0), in fp32."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / half)
    args = scale * (timesteps[:, None].float() * freqs[None, :])
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1)


def _rope_axis(index: torch.Tensor, dim: int) -> torch.Tensor:
    """complex64 [len(index), dim/2] rotations for one RoPE axis."""
    inv = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2, device="cpu").to(torch.float32).div(dim))
    angles = torch.outer(index, inv)
    return torch.polar(torch.ones_like(angles), angles)


def rope_tables(axes_dims: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positive and mirrored negative position tables, complex64 [4096, head_dim/2], on the CPU."""
    pos = torch.arange(ROPE_TABLE_LENGTH, device="cpu")
    neg = torch.arange(ROPE_TABLE_LENGTH, device="cpu").flip(0) * -1 - 1
    return (
        torch.cat([_rope_axis(pos, d) for d in axes_dims], dim=1),
        torch.cat([_rope_axis(neg, d) for d in axes_dims], dim=1),
    )


class Rope(NamedTuple):
    """Image and text rotations, [S, head_dim/2, 2] fp32 (cos, sin): real views of complex64 tables."""

    img: torch.Tensor
    txt: torch.Tensor


Grid = tuple[int, int, int]


@dataclass(frozen=True)
class ImageLayout:
    """The image tokens of one forward: the target's F x H x W grid, then each reference image's grid,
    appended in order (Edit: the input images' latents; diffusers' `img_shapes` of one sample). Host data
    only and hashable, so it keys RoPE caches and CUDA-graph captures; nothing in it syncs a step."""

    target: Grid
    references: tuple[Grid, ...] = ()

    @classmethod
    def of(cls, layout: "ImageLayout | Grid") -> "ImageLayout":
        """A layout, or a single grid (text-to-image) as the layout of that one image."""
        return layout if isinstance(layout, ImageLayout) else cls(tuple(layout))

    @property
    def grids(self) -> tuple[Grid, ...]:
        return (self.target, *self.references)

    @property
    def target_tokens(self) -> int:
        return math.prod(self.target)

    @property
    def tokens(self) -> int:
        return sum(math.prod(grid) for grid in self.grids)


def rope_frequencies(
    tables: tuple[torch.Tensor, torch.Tensor],
    axes_dims: tuple[int, int, int],
    layout: ImageLayout | Grid,
    text_len: int,
    layer3d: bool = False,
) -> Rope:
    """Image and text rotations with centered image positions: image i of the layout takes frame index i
    onward (diffusers' `QwenEmbedRope`), the text starts after the largest half-extent of all images.

    `layer3d` (Qwen-Image-Layered's `QwenEmbedLayer3DRope`): the last image, the condition, takes frame
    index -1, and the text starts no earlier than the number of grids before it (the layers)."""
    layout = ImageLayout.of(layout)
    splits = [d // 2 for d in axes_dims]
    pos = tables[0].split(splits, dim=1)
    neg = tables[1].split(splits, dim=1)
    images = []
    last = len(layout.grids) - 1
    for index, (frames, height, width) in enumerate(layout.grids):
        f = neg[0][-1:] if layer3d and index == last else pos[0][index : index + frames]
        f = f.view(frames, 1, 1, -1).expand(frames, height, width, -1)
        h = torch.cat([neg[1][-(height - height // 2) :], pos[1][: height // 2]], dim=0)
        h = h.view(1, height, 1, -1).expand(frames, height, width, -1)
        w = torch.cat([neg[2][-(width - width // 2) :], pos[2][: width // 2]], dim=0)
        w = w.view(1, 1, width, -1).expand(frames, height, width, -1)
        images.append(torch.cat([f, h, w], dim=-1).reshape(frames * height * width, -1))
    start = max(max(height // 2, width // 2) for _, height, width in layout.grids)
    if layer3d:
        start = max(start, last)
    return Rope(
        torch.view_as_real(torch.cat(images).contiguous()),
        torch.view_as_real(tables[0][start : start + text_len]),
    )


def joint_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """SDPA over [B, S, H, D] inputs; key_mask [B, S] bool hides padded keys.

    In a sequence-parallel forward (models/sequence_parallel.py) the inputs are this rank's rows of all
    heads: an all-to-all trades them for all rows of this rank's heads before SDPA, and back after it.
    """
    mask = None if key_mask is None else key_mask[:, None, None, :]
    shards = active_shards()
    if shards is None:
        q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
        return _sdpa(q, k, v, mask).permute(0, 2, 1, 3)
    q, k, v = shards.to_head_shards(query, key, value)
    return shards.to_sequence_shards(_sdpa(q, k, v, mask))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)


def joint_key_mask(text_mask: torch.Tensor | None, image_rows: int) -> torch.Tensor | None:
    """The key mask of the joint [text, image] sequence, [B, S_txt + S_img] bool, or None when no text is
    padded (image keys are always valid)."""
    if text_mask is None:
        return None
    return torch.cat([text_mask, text_mask.new_ones(text_mask.shape[0], image_rows)], dim=1)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2*W/2, C*4), channel index c*4 + dy*2 + dx."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, H/2*W/2, C*4) -> (B, C, 1, H, W) for latent height/width H, W."""
    b, _, channels = tokens.shape
    x = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, 1, height, width)
