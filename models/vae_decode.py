"""Single-frame VAE decoding: diffusers' `AutoencoderKLQwenImage.decode`, or opt-in its 2D form (`fast`).

diffusers decodes an image as the first frame of a video: each causal 3D convolution pads the frame with two
zero frames in front, so two of its kernel's three temporal taps multiply zeros (three times the convolution
work, plus the padded copies and the cache clones). The frame meets only the last tap, so the fast form runs
each of them as the 2D convolution of that tap, and the decoder without its frame cache. Same sums without
the zero terms, added in another order: close to diffusers' pixels, not identical (measured in BENCHMARKS,
"fast decode"), hence opt-in. The decoder's own modules run, their weights read at each call: a memory plan
may move or stream them, and nothing here holds a copy.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
from torch import nn

LOG = logging.getLogger("qwen_image")


@dataclass(frozen=True)
class DecodeReport:
    """How the VAE decoded a request, as decided where it ran: in its 2D form (`fast`, opt-in and
    approximate) or exactly, in tiles (a memory plan turned tiling on) or whole, and why a fast decode that
    was asked for fell back to the exact one ("" when none did)."""

    fast: bool
    tiled: bool
    fallback: str = ""

    def summary(self) -> str:
        form = "the VAE's 2D form (approximate)" if self.fast else "exact"
        how = f"{form}, {'in tiles' if self.tiled else 'whole'}"
        return f"{how} (fast decode fell back: {self.fallback})" if self.fallback else how


def last_tap_forward(
    conv: QwenImageCausalConv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None
) -> torch.Tensor:
    """`conv` applied to one frame with no cache: the 2D convolution of its last temporal tap, with its
    spatial padding. Reads the conv's weight at each call, so it follows any placement of it."""
    if x.shape[2] != 1 or cache_x is not None or conv.stride != (1, 1, 1):
        raise ValueError("a causal convolution has a last-tap form for one frame, no cache, stride 1 only")
    pad_w, _, pad_h, _, _, _ = conv._padding
    return F.conv2d(x[:, :, 0], conv.weight[:, :, -1], conv.bias, padding=(pad_h, pad_w)).unsqueeze(2)


@contextmanager
def last_tap_convs(decoder: nn.Module) -> Iterator[None]:
    """Inside, every causal convolution of `decoder` runs in its last-tap form (its own module, hooks and
    tensors: nothing is copied); after, each runs diffusers' forward again."""
    convs = [m for m in decoder.modules() if isinstance(m, QwenImageCausalConv3d)]
    for conv in convs:
        conv.forward = partial(last_tap_forward, conv)
    try:
        yield
    finally:
        for conv in convs:
            del conv.forward


def tiles(vae: nn.Module, z: torch.Tensor) -> bool:
    """Whether diffusers decodes latents `z` [B, C, T, h, w] in tiles (a memory plan turned tiling on): its
    Qwen-Image VAEs tile a size above their smallest tile."""
    if not getattr(vae, "use_tiling", False):
        return False
    height, width = z.shape[-2:]
    ratio = vae.spatial_compression_ratio
    small = width <= vae.tile_sample_min_width // ratio and height <= vae.tile_sample_min_height // ratio
    return not small


def fast_decode_fallback(vae: nn.Module, z: torch.Tensor) -> str:
    """Why latents `z` cannot take the 2D form ("" when they can)."""
    if not isinstance(vae, AutoencoderKLQwenImage):
        return f"{type(vae).__name__} has no 2D form here"
    if tiles(vae, z):
        return "the VAE decodes this size in tiles (memory plan)"
    return ""


@torch.no_grad()
def decode_frames(vae: nn.Module, z: torch.Tensor, fast: bool = False) -> tuple[torch.Tensor, DecodeReport]:
    """Pixels [B, C, H, W] in [-1, 1] of single-frame latents `z` [B, C, 1, h, w] (denormalized), and how
    they were decoded.

    `fast`: the 2D form (close, not identical): the decoder run without its frame cache, its causal
    convolutions in their last-tap form; where that does not apply (tiled decoding, another VAE) the exact
    decode runs, the report says why and so does the log."""
    fallback = fast_decode_fallback(vae, z) if fast else ""
    if fallback:
        LOG.warning("fast decode: %s; decoding exactly", fallback)
    if fast and not fallback:
        with last_tap_convs(vae.decoder):
            out = vae.decoder(vae.post_quant_conv(z))
        return out.clamp(-1.0, 1.0)[:, :, 0], DecodeReport(fast=True, tiled=False)
    report = DecodeReport(fast=False, tiled=tiles(vae, z), fallback=fallback)
    return vae.decode(z, return_dict=False)[0][:, :, 0], report
