"""Tiny Qwen-Image 2.1 fixtures: configs, diffusers' model and ours on the same random weights, and requests
(token layouts with condition images, padded prompt batches) as diffusers' pipeline would build them."""

import functools
import math
from dataclasses import dataclass

import torch
from diffusers import QwenImage21Transformer2DModel

from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer

CONFIGS = {
    "2 layers, 2 heads x 32, causal": QwenImage21Config(
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=32,
        num_attention_heads=2,
        context_in_dim=24,
        axes_dims_rope=(8, 12, 12),
    ),
    "1 layer, 4 heads x 16, MLP x2, not causal": QwenImage21Config(
        in_channels=8,
        out_channels=8,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=4,
        context_in_dim=40,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
        causal_condition=False,
    ),
    "3 layers, 3 heads x 48, patch 2, eps 1e-5, causal": QwenImage21Config(
        patch_size=2,
        in_channels=4,
        out_channels=6,
        num_layers=3,
        attention_head_dim=48,
        num_attention_heads=3,
        context_in_dim=32,
        axes_dims_rope=(8, 20, 20),
        eps=1e-5,
    ),
}


def diffusers_config(config: QwenImage21Config) -> dict:
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_")}


@functools.cache
def model_pair(name: str, dtype: torch.dtype) -> tuple[QwenImage21Transformer2DModel, QwenImage21Transformer]:
    """diffusers' model with random weights (std 0.3, as in tests/test_transformer_oracle.py) in `dtype` as
    its `from_pretrained(dtype=...)` leaves it (the non-persistent timestep frequencies stay FP32, which
    `model.to(dtype)` would round), and ours loading its state dict strictly; both in eval mode."""
    config = CONFIGS[name]
    torch.manual_seed(0)
    ref = QwenImage21Transformer2DModel(**diffusers_config(config))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    freqs = ref.time_text_embed.time_proj.freqs
    ref = ref.to(dtype).eval()
    ref.time_text_embed.time_proj.freqs = freqs
    ours = QwenImage21Transformer(config).to(dtype).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@dataclass(frozen=True)
class Request:
    """A vision-language sequence: `pieces` alternates text runs (int: token count) and condition images
    ((frames, height, width) in latent tokens); the target image closes it. `padded` gives the listed
    samples that many padding tokens at the end of their text."""

    batch: int
    pieces: tuple[int | tuple[int, int, int], ...]
    target: tuple[int, int, int]
    padded: tuple[tuple[int, int], ...] | None = None

    @property
    def img_shapes(self) -> list[tuple[int, int, int]]:
        return [p for p in self.pieces if isinstance(p, tuple)] + [self.target]

    def img_mask(self) -> torch.Tensor:
        """[B, L_vlm + T/4] bool: the image slots (4 latent tokens each) of condition images and target."""
        slots: list[bool] = []
        for piece in self.pieces:
            slots += [False] * piece if isinstance(piece, int) else [True] * (math.prod(piece) // 4)
        slots += [True] * (math.prod(self.target) // 4)
        return torch.tensor([slots] * self.batch)

    def text_mask(self) -> torch.Tensor | None:
        if self.padded is None:
            return None
        length = self.img_mask().shape[1] - math.prod(self.target) // 4
        mask = torch.ones(self.batch, length, dtype=torch.bool)
        for sample, pad in self.padded:
            mask[sample, length - pad :] = False
        return mask

    def inputs(self, config: QwenImage21Config, dtype: torch.dtype, seed: int):
        """(latents of all images [B, N, C], text embeddings [B, L_vlm, ctx], sigma [B]) from `seed`."""
        g = torch.Generator().manual_seed(seed)
        text_len = self.img_mask().shape[1] - math.prod(self.target) // 4
        images = sum(math.prod(s) for s in self.img_shapes)
        channels = config.in_channels * config.patch_size**2
        latents = torch.randn(self.batch, images, channels, generator=g).to(dtype)
        text = torch.randn(self.batch, text_len, config.context_in_dim, generator=g).to(dtype)
        sigma = torch.rand(1, generator=g).expand(self.batch).contiguous()
        return latents, text, sigma


REQUESTS = {
    "text to image": Request(batch=1, pieces=(7,), target=(1, 4, 4)),
    "prompt batch, padded": Request(batch=2, pieces=(9,), target=(1, 2, 6), padded=((1, 4),)),
    "one condition image, padded": Request(
        batch=2, pieces=(2, (1, 2, 4), 5), target=(1, 4, 6), padded=((1, 3),)
    ),
    "two condition images of different sizes, adjacent": Request(
        batch=2, pieces=(3, (1, 2, 2), (1, 4, 2), 2), target=(1, 2, 4), padded=((0, 1),)
    ),
}


def diffusers_forward(
    ref: QwenImage21Transformer2DModel, request: Request, latents, text, sigma, cache=None, mode=None
) -> torch.Tensor:
    """diffusers' transformer as its pipeline calls it (masks on the latents' device); returns every joint
    row it returns."""
    text_mask = request.text_mask()
    with torch.no_grad():
        return ref(
            hidden_states=latents,
            encoder_hidden_states=text,
            timestep=sigma,
            img_shapes=[request.img_shapes] * request.batch,
            img_mask=request.img_mask().to(latents.device),
            encoder_hidden_states_mask=None if text_mask is None else text_mask.to(latents.device),
            kv_cache=cache,
            kv_cache_mode=mode,
            return_dict=False,
        )[0]
