"""The opt-in fast decode on CUDA (models/vae_decode.py): on the full-size `AutoencoderKLQwenImage` in BF16
its pixels stay within a few 8-bit levels of diffusers' decode, it is deterministic, and the exact decode is
untouched by it (the frame decoder shares the VAE's tensors but not its causal convolutions); each says
which form ran."""

import pytest
import torch
from diffusers import AutoencoderKLQwenImage

from qwen_image_fusion.models.vae_decode import DecodeReport, decode_frames

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoencoderKLQwenImage().to(torch.bfloat16).eval()


def levels(pixels: torch.Tensor) -> torch.Tensor:
    return ((pixels.float() + 1) * 127.5).round()


def test_fast_decode_stays_within_a_few_levels_on_gpu(vae) -> None:
    z = torch.randn(2, 16, 1, 64, 96, device="cuda", dtype=torch.bfloat16)
    exact, exact_report = decode_frames(vae, z)
    fast, fast_report = decode_frames(vae, z, fast=True)
    assert (exact_report, fast_report) == (DecodeReport(False, False), DecodeReport(True, False))
    assert fast.shape == exact.shape == (2, 3, 512, 768)
    assert not torch.equal(fast, exact)  # another kernel's sums: the 2D form ran
    diff = (levels(fast) - levels(exact)).abs()
    moved = (diff > 0).float().mean().item()
    print(f"fast decode on CUDA: max {diff.max().item():.0f} levels, {moved:.1%} moved")
    assert diff.max().item() <= 4
    assert torch.equal(decode_frames(vae, z, fast=True)[0], fast)
    assert torch.equal(decode_frames(vae, z)[0], exact)
