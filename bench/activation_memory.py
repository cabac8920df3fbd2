"""Activation bytes of Qwen-Image's phases, traced with fake tensors (no data, any size, on a CPU): the live
bytes of every tensor an op allocates, counted until it is freed, during one text-encoder call, one
transformer call (diffusers' arithmetic, BF16) and one VAE decode, at the full-size configs; for the Edit
family also a transformer call with input images, a VAE encode and the vision tower (real tensors). The
coefficients of models/qwen_image/memory.py and models/qwen_image_edit/memory.py come from this; the GPU
benchmark (bench/memory_bench.py) checks the plans they give against measured peaks.

    python bench/activation_memory.py [--out activation_memory.json]      # about three minutes on a CPU
    python bench/activation_memory.py --family qwen-image-2.1 [--out ...]  # about five minutes
"""

import argparse
import json
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_image_fusion.models.qwen_image.text_encoder import qwen25_vl_7b_config


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors ops allocate while active (views share their base's storage and are
    not counted again; inputs made before are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


def traced_peak(build: Callable[[], torch.nn.Module], run: Callable[[torch.nn.Module], object]) -> int:
    """Peak activation bytes of `run(model)` for a model `build()` makes, all in fake BF16 tensors."""
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = build().eval()
        finally:
            torch.set_default_dtype(torch.float32)
        with torch.no_grad(), LiveBytes() as tracker:
            run(model)
    return tracker.peak


def transformer_peak(
    config, image_side: int, text_tokens: int, batch: int = 1, scale: int = 8, references: int = 0
) -> int:
    """One call of our transformer in diffusers' arithmetic (`reference`) at `config`, with `references`
    input images of the target's size appended (Edit)."""
    from qwen_image_fusion.models.qwen_image.math import ImageLayout
    from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer

    def build() -> torch.nn.Module:
        model = QwenImageTransformer(config)
        model.set_numerics("reference")
        return model

    grid = image_side // (2 * scale)

    layout = ImageLayout((1, grid, grid), ((1, grid, grid),) * references)

    def run(model) -> object:
        tokens = (1 + references) * grid * grid
        latents = torch.randn(batch, tokens, config.in_channels, dtype=torch.bfloat16)
        text = torch.randn(batch, text_tokens, config.joint_attention_dim, dtype=torch.bfloat16)
        return model(latents, text, None, torch.full((batch,), 0.5), layout)

    return traced_peak(build, run)


def text_encoder_peak(config, tokens: int, prompts: int = 1, model_class: type | None = None) -> int:
    """One text-encoder call as the pipeline makes it (all hidden states kept, one logit row): Qwen2.5-VL,
    or `model_class` (2.1's Qwen3-VL) built from `config`."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model_class = model_class or Qwen2_5_VLForConditionalGeneration

    def run(model) -> object:
        ids = torch.randint(0, 1000, (prompts, tokens))
        mask = torch.ones(prompts, tokens, dtype=torch.long)
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)

    return traced_peak(lambda: model_class(config), run)


def _vae(config: dict, vae_class: type | None, tiled: bool = False) -> torch.nn.Module:
    """diffusers' Qwen-Image VAE (or `vae_class`, 2.1's) from `config`, tiling its decode when `tiled`."""
    from diffusers import AutoencoderKLQwenImage

    vae = (vae_class or AutoencoderKLQwenImage).from_config(config)
    if tiled:
        vae.enable_tiling()
    return vae


def decode_peak(config: dict, image_side: int, tiled: bool, vae_class: type | None = None) -> int:
    """One decode of a `image_side`-square image by diffusers' Qwen-Image VAE (or `vae_class`), whole or in
    its tiles."""

    def run(vae) -> object:
        side = image_side // 2 ** len(vae.config.temperal_downsample)
        z = torch.randn(1, vae.config.z_dim, 1, side, side, dtype=torch.bfloat16)
        return vae.decode(z, return_dict=False)[0]

    return traced_peak(lambda: _vae(config, vae_class, tiled), run)


def encode_peak(config: dict, image_side: int, vae_class: type | None = None) -> int:
    """One encode of a `image_side`-square image by diffusers' Qwen-Image VAE (an Edit input image) or by
    `vae_class` (2.1's, RGBA)."""

    def run(vae) -> object:
        channels = vae.config.get("in_channels") or vae.config.input_channels
        x = torch.randn(1, channels, 1, image_side, image_side, dtype=torch.bfloat16)
        return vae.encode(x).latent_dist.mode()

    return traced_peak(lambda: _vae(config, vae_class), run)


def vision_peak(vision_config, images: int, image_side: int) -> int:
    """One call of Qwen2.5-VL's vision tower on `images` square images, with real tensors (its window
    indexing reads data, which fake tensors cannot): give a config of few layers, the peak is one layer's."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    vision_config._attn_implementation = "sdpa"
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config).to(torch.bfloat16).eval()
    side = image_side // vision_config.patch_size
    channels = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    pixels = torch.randn(images * side * side, channels, dtype=torch.bfloat16)
    grid = torch.tensor([[1, side, side]] * images)
    with torch.no_grad(), LiveBytes() as tracker:
        model(pixels, grid_thw=grid)
    return tracker.peak


def qi21_transformer_peak(
    config, image_side: int, text_tokens: int, conditions: int = 0, cache: bool = True
) -> tuple[int, int | None]:
    """(full pass, cached target step) of Qwen-Image 2.1's transformer at `config` (fake tensors), with
    `conditions` condition images of the target's size in the prefix; without `cache` the full pass makes
    its keys and values per block and there is no cached step. The KV cache itself is not counted (the
    planner counts it exactly)."""
    from qwen_image_fusion.models.qwen_image21.layout import build_layout, rope_tables
    from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer

    grid = image_side // 16
    target = grid * grid
    text = [False] * text_tokens
    slots = text[: text_tokens // 2] + [True] * (conditions * target // 4) + text[text_tokens // 2 :]
    img_mask = torch.tensor([slots + [True] * (target // 4)])
    shapes = [(1, grid, grid)] * (conditions + 1)
    tables = rope_tables(config.axes_dims_rope)
    layout = build_layout(img_mask, shapes, None, tables, config.causal_condition, torch.device("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = QwenImage21Transformer(config).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        latents = torch.randn(1, (conditions + 1) * target, config.in_channels, dtype=torch.bfloat16)
        embeds = torch.randn(1, layout.text_len, config.context_in_dim, dtype=torch.bfloat16)
        sigma = torch.full((1,), 0.5)
        kv = model.new_kv_cache(layout, torch.bfloat16) if cache else None
        with torch.no_grad(), LiveBytes() as full:
            model(latents, embeds, sigma, layout, kv)
        if kv is None:
            return full.peak, None
        with torch.no_grad(), LiveBytes() as cached:
            model.forward_cached(latents[:, -target:], sigma, layout, kv)
    return full.peak, cached.peak


def qi21_vision_peak(vision: dict, images: int, image_side: int) -> int:
    """Qwen3-VL's vision tower on `images` square images, with real tensors (its position interpolation
    reads data): give a config of few layers, the peak is one layer's plus the deepstack outputs."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from qwen_image_fusion.models.qwen_image21.synthetic import QWEN3_VL_8B_TEXT, text_encoder_config

    config = text_encoder_config(QWEN3_VL_8B_TEXT, vision).vision_config
    config._attn_implementation = "sdpa"
    model = Qwen3VLVisionModel._from_config(config).to(torch.bfloat16).eval()
    side = image_side // config.patch_size
    channels = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(images * side * side, channels, dtype=torch.bfloat16)
    with torch.no_grad(), LiveBytes() as tracker:
        model(pixels, grid_thw=torch.tensor([[1, side, side]] * images))
    return tracker.peak


def qi21_rows() -> dict[str, list[dict]]:
    """2.1's measurements: per joint (full pass) or target (cached step) token and width, per text token
    and hidden size, per output or input pixel and base_dim, per vision patch and width."""
    from diffusers import AutoencoderKLQwenImage21
    from transformers import Qwen3VLForConditionalGeneration

    from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
    from qwen_image_fusion.models.qwen_image21.synthetic import (
        QWEN3_VL_8B_TEXT,
        QWEN3_VL_8B_VISION,
        text_encoder_config,
    )

    dit = QwenImage21Config(num_layers=2)
    rows: dict[str, list[dict]] = {"transformer": [], "text_encoder": [], "vae": [], "vision_tower": []}
    calls = [(1024, 128, 0, True), (1024, 1024, 0, True), (1024, 1024, 1, True), (2048, 1024, 0, True)]
    for side, text, conditions, cache in [*calls, (1024, 1024, 0, False)]:
        full, cached = qi21_transformer_peak(dit, side, text, conditions, cache)
        joint, target = text + (conditions + 1) * (side // 16) ** 2, (side // 16) ** 2
        row = {"side": side, "text": text, "conditions": conditions, "cache": cache, "full_bytes": full}
        row["full_per_token_per_width"] = full / joint / dit.inner_dim
        if cached is not None:
            row |= {"cached_bytes": cached, "cached_per_token_per_width": cached / target / dit.inner_dim}
        rows["transformer"].append(row)
    text_encoder = text_encoder_config(QWEN3_VL_8B_TEXT, QWEN3_VL_8B_VISION)
    for tokens in (64, 1058):
        peak = text_encoder_peak(text_encoder, tokens, model_class=Qwen3VLForConditionalGeneration)
        rows["text_encoder"].append(
            {"tokens": tokens, "bytes": peak, "per_token_per_hidden": peak / tokens / 4096}
        )
    vae_calls = [(512, True, False), (1024, True, False), (512, True, True), (1024, True, True)]
    for side, decode, tiled in [*vae_calls, (1024, False, False)]:
        if decode:
            peak = decode_peak({}, side, tiled, AutoencoderKLQwenImage21)
        else:
            peak = encode_peak({}, side, AutoencoderKLQwenImage21)
        base = 144 if decode else 96  # the decoder's and the encoder's base_dim
        row = {"side": side, "decode": decode, "tiled": tiled, "bytes": peak}
        rows["vae"].append(row | {"per_pixel_per_base_dim": peak / side**2 / base})
    vision = QWEN3_VL_8B_VISION | {"depth": 2, "deepstack_visual_indexes": [0]}
    for images, side in ((1, 512), (1, 1024)):
        peak = qi21_vision_peak(vision, images, side)
        patches = images * (side // 16) ** 2
        rows["vision_tower"].append(
            {"images": images, "side": side, "bytes": peak, "per_patch_per_width": peak / patches / 1152}
        )
    return rows


def main() -> None:
    from qwen_image_fusion.models.qwen_image.config import QwenImageConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--family", choices=["qwen-image", "qwen-image-2.1"], default="qwen-image")
    args = parser.parse_args()
    if args.family == "qwen-image-2.1":
        text = json.dumps(qi21_rows(), indent=2)
        print(text)
        if args.out is not None:
            args.out.write_text(text)
        return
    dit = QwenImageConfig(num_layers=2)
    rows = {"transformer": [], "text_encoder": [], "vae_decode": []}
    for side, text in ((512, 128), (1024, 128), (1024, 1024), (2048, 1024)):
        peak = transformer_peak(dit, side, text)
        per = peak / ((side // 16) ** 2 + text) / dit.inner_dim
        rows["transformer"].append({"side": side, "text": text, "bytes": peak, "per_token_per_width": per})
    for tokens in (64, 1058):
        peak = text_encoder_peak(qwen25_vl_7b_config(), tokens)
        rows["text_encoder"].append(
            {"tokens": tokens, "bytes": peak, "per_token_per_hidden": peak / tokens / 3584}
        )
    for side, tiled in ((512, False), (512, True), (1024, False), (1024, True)):
        peak = decode_peak({}, side, tiled)
        rows["vae_decode"].append(
            {"side": side, "tiled": tiled, "bytes": peak, "per_pixel_per_base_dim": peak / side**2 / 96}
        )
    edit = QwenImageConfig(num_layers=2, zero_cond_t=True)  # Edit-2511: one and three input images
    rows["edit_transformer"] = []
    for references in (1, 3):
        peak = transformer_peak(edit, 1024, 1024, references=references)
        per = peak / ((1 + references) * 4096 + 1024) / edit.inner_dim
        rows["edit_transformer"].append({"references": references, "bytes": peak, "per_token_per_width": per})
    peak = encode_peak({}, 1024)
    rows["vae_encode"] = [{"side": 1024, "bytes": peak, "per_pixel_per_base_dim": peak / 1024**2 / 96}]
    vision = qwen25_vl_7b_config(vision=True).vision_config
    vision.depth, vision.fullatt_block_indexes = 2, [1]  # one windowed and one full-attention layer
    rows["vision_tower"] = []
    for images, side in ((1, 392), (3, 392)):  # Edit-2509/2511's 384x384-area inputs
        peak = vision_peak(vision, images, side)
        patches = images * (side // 14) ** 2
        rows["vision_tower"].append(
            {"images": images, "side": side, "bytes": peak, "per_patch_per_width": peak / patches / 1280}
        )
    text = json.dumps(rows, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
