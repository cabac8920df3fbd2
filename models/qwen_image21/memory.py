"""Qwen-Image 2.1's memory profile (torch-free): its components' device bytes from the safetensors headers
(Qwen-Image's reading: the Qwen3-VL text encoder's language layers are its blocks, the vision tower sits in
its fixed part) and the activations of each phase, with the prefix KV cache the steps keep.

The coefficients were measured by `bench/activation_memory.py --family qwen-image-2.1` (fake tensors at the
released sizes in BF16, diffusers' arithmetic; the vision tower with real tensors) and are rounded up by
about 15%: the text encoder 130.4 x hidden bytes per token (its 37 hidden states are all kept), the vision
tower 43.9 x width bytes per patch, the transformer's full pass 36.0 x width bytes per joint token (40.0
without a cache, whose keys and values are then made per block), its cached step 32.0 x width bytes per
target token, the VAE decoder 44.7 x decoder_base_dim bytes per output pixel (2.92e6 x decoder_base_dim per
image plus 14.8 bytes per pixel in diffusers' tiles), its encoder 22.2 x base_dim bytes per input pixel.

With the KV cache (the checkpoint's `causal_condition` and QWEN_IMAGE_KV_CACHE on), each CFG branch keeps
[layers, 2, B, S, width] keys and values of its whole sequence across steps and requests (models/qwen_image21/
steps.py), counted exactly; its first step is the full pass, run eagerly, and the captured graphs replay
the target-only step. Without it every step is the full pass. Condition images are `OUTPUT_RESOLUTION`
squared pixels each (10% to spare for the rounding of their sides): their latents join every sequence,
the vision tower reads their patches, the language model their vision tokens, and the VAE encodes them
whole (the decode phase's bound covers it, the VAE being resident).
"""

import math
from dataclasses import dataclass
from pathlib import Path

from qwen_image_fusion.models.checkpoint import read_json
from qwen_image_fusion.models.env import env_flag
from qwen_image_fusion.models.memory import MemoryProfile, Workload
from qwen_image_fusion.models.qwen_image.memory import component_parts
from qwen_image_fusion.models.qwen_image21.checkpoint import (
    KV_CACHE_ENV,
    OUTPUT_RESOLUTION,
    SLOT_TOKENS,
    VAE_SCALE,
)
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image_edit.memory import AREA_SLACK

TEXT_BYTES_PER_HIDDEN = 150  # per text-encoder token: measured 130.4
VISION_BYTES_PER_WIDTH = 50  # per patch: measured 43.9
FULL_STEP_BYTES_PER_WIDTH = 41  # per joint token: measured 36.0
UNCACHED_STEP_BYTES_PER_WIDTH = 46  # per joint token, no KV cache: measured 40.0
CACHED_STEP_BYTES_PER_WIDTH = 37  # per target token: measured 32.0
DECODE_BYTES_PER_BASE = 51  # per output pixel and decoder base_dim: measured 44.7
TILE_BYTES_PER_BASE = 3.4e6  # per image decoded in tiles: measured 2.92e6
TILE_BYTES_PER_PIXEL = 17  # the tiles' blended output: measured 14.8
ENCODE_BYTES_PER_BASE = 26  # per input pixel: measured 22.2
TEMPLATE_TOKENS = 40  # the template's system turn and its ends, around each prompt


@dataclass(frozen=True)
class Activations21:
    """Activation bytes of 2.1's phases for a workload, at `dtype_bytes` per element."""

    text_hidden: int
    width: int
    layers: int
    vae_base: int
    decoder_base: int
    vision_width: int
    vision_patch: int
    kv_cache: bool
    dtype_bytes: int

    def condition_tokens(self) -> int:
        """Joint tokens of one condition image's latents."""
        return math.ceil(OUTPUT_RESOLUTION**2 * AREA_SLACK / VAE_SCALE**2)

    def vision_patches(self) -> int:
        return math.ceil(OUTPUT_RESOLUTION**2 * AREA_SLACK / self.vision_patch**2)

    def sequence(self, workload: Workload) -> int:
        """Joint tokens of one sample: text, condition images' latents, the target."""
        text = workload.text_tokens + TEMPLATE_TOKENS
        return text + workload.input_images * self.condition_tokens() + self.target(workload)

    @staticmethod
    def target(workload: Workload) -> int:
        return (workload.width // VAE_SCALE) * (workload.height // VAE_SCALE)

    def _bytes(self, elements: float) -> int:
        return round(elements * self.dtype_bytes / 2)

    def encode(self, workload: Workload) -> int:
        """One text-encoder call: each prompt with every condition image's vision tokens (SLOT_TOKENS latent
        tokens each) and the vision tower over each prompt's copies of the images."""
        vision_tokens = self.condition_tokens() // SLOT_TOKENS
        per_prompt = workload.text_tokens + TEMPLATE_TOKENS + workload.input_images * vision_tokens
        patches = workload.prompts * workload.input_images * self.vision_patches()
        text = workload.prompts * per_prompt * TEXT_BYTES_PER_HIDDEN * self.text_hidden
        return self._bytes(text + patches * VISION_BYTES_PER_WIDTH * self.vision_width)

    def step(self, workload: Workload) -> int:
        """The step the graphs capture: the target-only pass with the cache, else the full pass."""
        if self.kv_cache:
            tokens, per_width = self.target(workload), CACHED_STEP_BYTES_PER_WIDTH
        else:
            tokens, per_width = self.sequence(workload), UNCACHED_STEP_BYTES_PER_WIDTH
        return self._bytes(workload.images * tokens * per_width * self.width)

    def first_step(self, workload: Workload) -> int:
        """A branch's first step: the full pass filling the cache, eager."""
        if not self.kv_cache:
            return self.step(workload)
        tokens = workload.images * self.sequence(workload)
        return self._bytes(tokens * FULL_STEP_BYTES_PER_WIDTH * self.width)

    def held(self, workload: Workload) -> int:
        """Each CFG branch's KV cache: [layers, 2, B, S, width]."""
        if not self.kv_cache:
            return 0
        branches = 2 if workload.true_cfg else 1
        per_branch = self.layers * 2 * workload.images * self.sequence(workload) * self.width
        return branches * per_branch * self.dtype_bytes

    def step_cache(self, workload: Workload) -> int:
        """The one stream's tensors, three kept and two temporaries, for the captured steps' rows and (with
        the KV cache) the full pass's, which keeps its own."""
        rows = self.sequence(workload) + (self.target(workload) if self.kv_cache else 0)
        return workload.images * 5 * rows * self.width * self.dtype_bytes

    def decode(self, workload: Workload, tiled: bool) -> int:
        """Decoding the outputs, or encoding one condition image, always whole (the larger)."""
        pixels = workload.width * workload.height
        if tiled:
            per_image = TILE_BYTES_PER_BASE * self.decoder_base + TILE_BYTES_PER_PIXEL * pixels
        else:
            per_image = DECODE_BYTES_PER_BASE * self.decoder_base * pixels
        encode = ENCODE_BYTES_PER_BASE * self.vae_base * OUTPUT_RESOLUTION**2 * AREA_SLACK
        return self._bytes(max(workload.decoded * per_image, encode if workload.input_images else 0))


def memory_profile(directory: Path, dtype_bytes: int, vae_dtype_bytes: int) -> MemoryProfile:
    """The profile of a 2.1 checkpoint whose configs `read_configs21` has checked."""
    transformer = QwenImage21Config.from_dict(read_json(directory / "transformer" / "config.json"))
    text = read_json(directory / "text_encoder" / "config.json")
    vae = read_json(directory / "vae" / "config.json")
    vision = text.get("vision_config", {})
    base = vae.get("base_dim", 96)
    activations = Activations21(
        text_hidden=text.get("text_config", {}).get("hidden_size", 4096),
        width=transformer.inner_dim,
        layers=transformer.num_layers,
        vae_base=base,
        decoder_base=vae.get("decoder_base_dim") or base,
        vision_width=vision.get("hidden_size", 1152),
        vision_patch=vision.get("patch_size", 16),
        kv_cache=transformer.causal_condition and env_flag(KV_CACHE_ENV),
        dtype_bytes=dtype_bytes,
    )
    return MemoryProfile(component_parts(directory, dtype_bytes, vae_dtype_bytes), activations)
