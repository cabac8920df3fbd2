"""Single-frame VAE decoding: diffusers' `AutoencoderKLQwenImage.decode`, or opt-in its 2D form (`fast`).

diffusers decodes an image as the first frame of a video: each causal 3D convolution pads the frame with two
zero frames in front, so two of its kernel's three temporal taps multiply zeros (three times the convolution
work, plus the padded copies and the cache clones). The frame meets only the last tap, so the fast form runs
each of them as the 2D convolution of that tap, and the decoder without its frame cache. Same sums without
the zero terms, added in another order: close to diffusers' pixels, not identical (measured in BENCHMARKS,
"fast decode"), hence opt-in. Every other module of the decoder is shared, not copied.
"""

import copy
import logging
import weakref

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
from torch import nn

LOG = logging.getLogger("qwen_image")
_FRAME_DECODERS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


class LastTapConv(nn.Module):
    """A causal 3D convolution applied to one frame with no cache: the 2D convolution of its last temporal
    tap, with its spatial padding."""

    def __init__(self, conv: QwenImageCausalConv3d) -> None:
        super().__init__()
        pad_w, _, pad_h, _, _, _ = conv._padding
        if conv.stride != (1, 1, 1):
            raise ValueError(f"a strided causal convolution ({conv.stride}) has no last-tap form")
        self.weight = nn.Parameter(conv.weight.detach()[:, :, -1].contiguous(), requires_grad=False)
        self.bias = None if conv.bias is None else conv.bias
        self.padding = (pad_h, pad_w)

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[2] != 1 or cache_x is not None:
            raise ValueError("LastTapConv decodes one frame with no frame cache")
        return F.conv2d(x[:, :, 0], self.weight, self.bias, padding=self.padding).unsqueeze(2)


def frame_decoder(vae: AutoencoderKLQwenImage) -> nn.Module:
    """`vae.decoder` with each causal convolution in its last-tap form, built once per VAE; the other
    parameters are the VAE's own tensors."""
    if vae not in _FRAME_DECODERS:
        decoder = vae.decoder
        memo: dict[int, object] = {id(t): t for t in (*decoder.parameters(), *decoder.buffers())}
        memo |= {id(m): LastTapConv(m) for m in decoder.modules() if isinstance(m, QwenImageCausalConv3d)}
        _FRAME_DECODERS[vae] = copy.deepcopy(decoder, memo).eval()
    return _FRAME_DECODERS[vae]


def tiles(vae: AutoencoderKLQwenImage, z: torch.Tensor) -> bool:
    """Whether diffusers decodes latents `z` [B, C, T, h, w] in tiles (a memory plan turned tiling on)."""
    height, width = z.shape[-2:]
    ratio = vae.spatial_compression_ratio
    small = width <= vae.tile_sample_min_width // ratio and height <= vae.tile_sample_min_height // ratio
    return bool(vae.use_tiling) and not small


@torch.no_grad()
def decode_frames(vae: nn.Module, z: torch.Tensor, fast: bool = False) -> torch.Tensor:
    """Pixels [B, C, H, W] in [-1, 1] of single-frame latents `z` [B, C, 1, h, w] (denormalized).

    `fast`: the 2D form (close, not identical); where it does not apply (tiled decoding, another VAE) the
    exact decode runs and the log says why."""
    if fast and not isinstance(vae, AutoencoderKLQwenImage):
        LOG.warning("fast decode: %s has no 2D form here; decoding exactly", type(vae).__name__)
    elif fast and tiles(vae, z):
        LOG.warning("fast decode: the VAE decodes this size in tiles (memory plan); decoding exactly")
    elif fast:
        out = frame_decoder(vae)(vae.post_quant_conv(z))
        return out.clamp(-1.0, 1.0)[:, :, 0]
    return vae.decode(z, return_dict=False)[0][:, :, 0]
