"""Qwen-Image's memory profile (torch-free): its components' device bytes from the safetensors headers and
an estimate of the activations of each phase.

The activation coefficients were measured by `bench/activation_memory.py`: the live bytes of a forward
traced with fake tensors (no data, every allocation counted until freed) at the full-size configs in BF16,
diffusers' arithmetic (`reference`): the text encoder 108 x hidden bytes per token (its 29 hidden states
are all kept), the transformer 27.7 x width bytes per joint token, the VAE decoder 36 x base_dim bytes per
output pixel with num_res_blocks 2, the default (2.4 MB x base_dim plus 10 bytes per pixel in diffusers'
tiles). The estimates below round
each up by about 15%; the GPU's own allocations (cuDNN and cuBLAS workspaces, allocator rounding) are the
planner's reserve. The H200 benchmark (bench/memory_bench.py) checks the peaks against the budget.
"""

from dataclasses import dataclass
from pathlib import Path

from qwen_image_fusion.models.checkpoint import read_json
from qwen_image_fusion.models.family import MAX_SEQUENCE_LENGTH
from qwen_image_fusion.models.memory import (
    DECODE,
    DENOISE,
    ENCODE,
    MemoryProfile,
    PartSizes,
    Workload,
    component_tensors,
    loaded_bytes,
    part_sizes,
)
from qwen_image_fusion.models.qwen_image.prompt_template import DROP_TOKENS

TEXT_BYTES_PER_HIDDEN = 124  # per token: measured 108
STEP_BYTES_PER_WIDTH = 32  # per joint token: measured 27.7
DECODE_BYTES_PER_BASE = 41  # per output pixel: measured 36 (num_res_blocks 2)
TILE_BYTES_PER_BASE = 2.8e6  # per image decoded in tiles: measured 2.4e6
TILE_BYTES_PER_PIXEL = 12  # the tiles' blended output: measured 10
ENCODE_BYTES_PER_BASE = 23  # per input pixel: measured 20.2
TEMPLATE_TOKENS = DROP_TOKENS + 8  # the prompt template's system part and its end


@dataclass(frozen=True)
class QwenImageActivations:
    """Activation bytes of Qwen-Image's three phases for a workload, at `dtype_bytes` per element."""

    text_hidden: int
    width: int
    vae_base: int
    vae_scale: int
    dtype_bytes: int

    def encode(self, workload: Workload) -> int:
        tokens = workload.prompts * (MAX_SEQUENCE_LENGTH + TEMPLATE_TOKENS)  # the tokenizer's cap
        return self.text_bytes(tokens)

    def stream_tokens(self, workload: Workload) -> tuple[int, int]:
        """Tokens of one sample's image and text streams."""
        image_tokens = (workload.width // (2 * self.vae_scale)) * (workload.height // (2 * self.vae_scale))
        return image_tokens, workload.text_tokens

    def step(self, workload: Workload) -> int:
        return self.step_bytes(workload.images * sum(self.stream_tokens(workload)))

    def step_cache(self, workload: Workload) -> int:
        """Three image-stream and two text-stream tensors kept, two image-stream temporaries."""
        image, text = self.stream_tokens(workload)
        return workload.images * (5 * image + 2 * text) * self.width * self.dtype_bytes

    def step_bytes(self, tokens: int) -> int:
        """One transformer call over `tokens` joint tokens (all samples)."""
        return round(tokens * STEP_BYTES_PER_WIDTH * self.width * self.dtype_bytes / 2)

    def text_bytes(self, tokens: int) -> int:
        """One text-encoder call over `tokens` tokens (all prompts), every hidden state kept."""
        return round(tokens * TEXT_BYTES_PER_HIDDEN * self.text_hidden * self.dtype_bytes / 2)

    def first_step(self, workload: Workload) -> int:
        """Every step is the same call."""
        return self.step(workload)

    def held(self, workload: Workload) -> int:
        """Nothing: Qwen-Image's steps keep no buffers but the graphs' pools."""
        return 0

    def decode(self, workload: Workload, tiled: bool) -> int:
        """Decoding the outputs, or encoding a start image at the output size, always whole (the larger)."""
        pixels = workload.width * workload.height
        if tiled:
            per_image = TILE_BYTES_PER_BASE * self.vae_base + TILE_BYTES_PER_PIXEL * pixels
        else:
            per_image = DECODE_BYTES_PER_BASE * self.vae_base * pixels
        start = ENCODE_BYTES_PER_BASE * self.vae_base * pixels if workload.start_image else 0
        return round(max(workload.decoded * per_image, start) * self.dtype_bytes / 2)


def memory_profile(directory: Path, dtype_bytes: int, vae_dtype_bytes: int) -> MemoryProfile:
    """The profile of a Qwen-Image checkpoint whose configs `inspect` has checked, for components loaded in
    a dtype of `dtype_bytes` (the VAE in `vae_dtype_bytes`)."""
    return MemoryProfile(
        component_parts(directory, dtype_bytes, vae_dtype_bytes), activations(directory, dtype_bytes)
    )


def component_parts(directory: Path, dtype_bytes: int, vae_dtype_bytes: int) -> tuple[PartSizes, ...]:
    """The text encoder (its vision tower, if any, in its fixed part), transformer and VAE as they sit on
    the device, from the safetensors headers."""

    return (
        part_sizes(
            "text_encoder",
            ENCODE,
            component_tensors(directory / "text_encoder"),
            lambda _: dtype_bytes,
            block_key=r"(?:^|\.)layers\.(\d+)\.",
            block_path="model.language_model.layers",
        ),
        part_sizes(
            "transformer",
            DENOISE,
            component_tensors(directory / "transformer"),
            lambda tensor: loaded_bytes(tensor, dtype_bytes),
            block_key=r"^transformer_blocks\.(\d+)\.",
            block_path="transformer_blocks",
            graphed=True,
        ),
        part_sizes("vae", DECODE, component_tensors(directory / "vae"), lambda _: vae_dtype_bytes),
    )


def activation_fields(directory: Path, dtype_bytes: int) -> dict[str, int]:
    """`QwenImageActivations`' fields from a checkpoint's configs (subclasses add their own)."""
    transformer = read_json(directory / "transformer" / "config.json")
    vae = read_json(directory / "vae" / "config.json")
    text = read_json(directory / "text_encoder" / "config.json")
    return dict(
        text_hidden=text.get("text_config", {}).get("hidden_size", text.get("hidden_size")),
        width=transformer.get("num_attention_heads", 24) * transformer.get("attention_head_dim", 128),
        vae_base=vae.get("base_dim", 96),
        vae_scale=2 ** len(vae.get("temperal_downsample", (False, True, True))),
        dtype_bytes=dtype_bytes,
    )


def activations(directory: Path, dtype_bytes: int) -> QwenImageActivations:
    """Qwen-Image's activation estimate for a checkpoint, at `dtype_bytes` per element."""
    return QwenImageActivations(**activation_fields(directory, dtype_bytes))
