"""Compiled q/k RMSNorm + RoPE on CUDA against the torch twin (DESIGN §4 style, kernels/qk_norm_rope.py).

At the model's shapes (1024x1024 with 128 text tokens: 4096 image + 128 text rows of 24 heads x 128) and
small ones, x a strided view of a projection output, the result written into a slice of a NaN-filled
joint [text, image] buffer, the real model's RoPE tables, inputs holding every bf16 encoding plus zero,
subnormal, huge, inf and NaN rows:
- every row is the contract's (nearest-even) for a sum of squares within a few fp32 ulps of torch's: the
  only freedom the contract leaves; values differing from the twin are counted and printed (-s) and
  bounded as in test_kernels_gpu.py (rows whose sum of squares may overflow fp32 in some order excluded);
- the slice write gives the bytes of a fresh output and leaves the other rows of the buffer untouched.
"""

import pytest
import torch
from steps import step_distance
from test_qk_norm_rope import EPS, explained_by_sum_order, same_rows

import qwen_image_fusion.kernels.qk_norm_rope as qk_norm_rope
from qwen_image_fusion.kernels.qk_norm_rope import rms_norm_rope, rms_norm_rope_torch, rms_norm_rope_triton
from qwen_image_fusion.models.qwen_image.math import rope_frequencies, rope_tables

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
AXES = {128: (16, 56, 56), 32: (8, 12, 12)}
# (batch, text tokens, image grid side, heads, head_dim, which rows of the joint sequence x is)
CASES = [
    (2, 128, 64, 24, 128, "joint"),  # [2, 4224, 24, 128]: the whole joint sequence
    (2, 128, 64, 24, 128, "image"),  # [2, 4096, 24, 128] after 128 text rows
    (2, 128, 64, 24, 128, "text"),  # [2, 128, 24, 128] before 4096 image rows
    (1, 7, 3, 24, 128, "image"),
    (2, 5, 4, 2, 32, "text"),  # the embedded model
    (1, 1, 1, 1, 128, "text"),
]


def model_rope(text: int, side: int, dim: int) -> dict[str, torch.Tensor]:
    """The model's real rotations ([S, D/2, 2] fp32) for a side x side latent grid and `text` tokens."""
    tables = tuple(t.to(CUDA) for t in rope_tables(AXES[dim]))
    rope = rope_frequencies(tables, AXES[dim], (1, side, side), text)
    return {"image": rope.img, "text": rope.txt, "joint": torch.cat([rope.txt, rope.img])}


def projection_heads(batch: int, seq: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    """x as the [B, S, H, D] view of a [B, S, H*D] projection: rows of varied scale, every bf16 encoding
    where there is room, and rows of zeros, subnormals, huge values, an inf and a NaN."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    spread = torch.exp(2 * torch.randn(batch, seq, heads, 1, device=CUDA, generator=g))
    x = (torch.randn(batch, seq, heads, dim, device=CUDA, generator=g) * spread).bfloat16()
    rows = x.view(-1, dim)
    encodings = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device=CUDA).to(torch.int16)
    if rows.shape[0] >= 2 * (1 << 16) // dim:
        rows[: (1 << 16) // dim] = encodings.view(torch.bfloat16).view(-1, dim)
    if rows.shape[0] >= 16:
        special = rows[-5:]
        special[0] = 0.0
        special[1] = rows[1] * 2.0**-130  # subnormal bf16
        special[2] = 2.0**100 * rows[2]  # squares overflow fp32 in any order
        special[3, 3] = float("inf")
        special[4, 4] = float("nan")
    return x.flatten(2).unflatten(-1, (heads, dim))


def sum_order_safe(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, 1] rows whose sum of squares is far from fp32 overflow, overflows in any order, or is NaN."""
    squares = x.double().square()
    sum_sq = squares.sum(-1, keepdim=True)
    return (sum_sq < 1e37) | (squares.amax(-1, keepdim=True) > 3.5e38) | sum_sq.isnan()


@pytest.mark.parametrize("batch, text, side, heads, dim, part", CASES)
def test_triton_vs_twin(batch, text, side, heads, dim, part):
    rope = model_rope(text, side, dim)
    seq = {"joint": text + side * side, "image": side * side, "text": text}[part]
    x = projection_heads(batch, seq, heads, dim, seed=seq * heads)
    g = torch.Generator(device=CUDA).manual_seed(dim)
    weight = (1 + 0.2 * torch.randn(dim, device=CUDA, generator=g)).bfloat16()
    before = {"joint": 0, "image": text, "text": 0}[part]
    joint = torch.full(
        (batch, text + side * side, heads, dim), float("nan"), dtype=torch.bfloat16, device=CUDA
    )
    rows = joint[:, before : before + seq]

    assert rms_norm_rope_triton(x, weight, rope[part], EPS, out=rows) is rows
    fresh = rms_norm_rope_triton(x, weight, rope[part], EPS)
    assert bool(same_rows(fresh, rows).all()) and torch.equal(fresh.view(torch.int16), rows.view(torch.int16))
    outside = torch.ones(joint.shape[1], dtype=torch.bool, device=CUDA)
    outside[before : before + seq] = False
    assert bool(joint[:, outside].isnan().all())

    twin = rms_norm_rope_torch(x, weight, rope[part], EPS)
    explained, _ = explained_by_sum_order(rows, x, weight, rope[part])
    safe = sum_order_safe(x)
    dist = step_distance(rows, twin)
    ok = safe.expand_as(dist)
    bad = int((dist[ok] > 0).sum())
    worst = int(dist[ok].max()) if bad else 0
    bad_rows = int((~same_rows(rows, twin) & safe).sum())
    print(
        f"{part} {tuple(x.shape)}: {bad} of {int(ok.sum())} values differ from the twin (max {worst} steps) "
        f"in {bad_rows} rows; {int((dist[~ok] > 0).sum())} in {int((~safe).sum())} overflow-prone rows"
    )
    assert bool(explained[safe].all())
    assert bad <= max(8, twin.numel() // 10_000)


def test_dispatch_on_cuda_uses_triton(monkeypatch):
    def no_twin(*_):
        raise AssertionError("CUDA input the guard accepts must not fall back to the torch twin")

    monkeypatch.setattr(qk_norm_rope, "rms_norm_rope_torch", no_twin)
    rope = model_rope(8, 4, 128)["image"]
    x = projection_heads(2, 16, 24, 128, seed=3)
    weight = torch.ones(128, dtype=torch.bfloat16, device=CUDA)
    got = rms_norm_rope(x, weight, rope, EPS)
    assert torch.equal(got.view(torch.int16), rms_norm_rope_triton(x, weight, rope, EPS).view(torch.int16))
