"""Requests that share a forward pass, run as one batch whose rows equal each request served alone.

Requests batch together when they agree on everything but prompt, negative prompt and seed (their
`BatchSettings`, the batching key) and their conditionings have the same shapes (`signature`). Each
request is encoded alone, exactly as `Pipeline.generate` encodes one prompt, and decoded alone; only the
denoising loop runs on the stacked rows, each request's rows from its own seed's noise.

Kernels may compute a row differently at another row count: on a CPU an FP32 linear over one row takes
another path (GEMV) than over two, and cuBLAS picks kernels by shape. So a batch always runs at the fixed
number of requests its settings allow (`BatchPlan.slots`), the empty slots filled with copies of the first
request: a request served alone runs the same shapes as in a full batch, so its bytes are the same
whichever batch and slot it lands in. The cost: a request alone computes the whole batch.
"""

from dataclasses import dataclass

import PIL.Image
import torch

from models.family import DEFAULT_SEQUENCE_LENGTH, Conditioning
from pipelines.pipeline import _StageTimer
from pipelines.presets import get_preset

# Estimated device memory one image row of a denoising step needs per megapixel (activations of a
# Qwen-Image-sized DiT in BF16 plus a captured CUDA graph's pool); bench/server_load.py prints the peak.
STEP_BYTES_PER_MEGAPIXEL = 2 * 2**30


@dataclass(frozen=True)
class BatchSettings:
    """What every request of a batch shares besides the model state (variant, LoRA scales)."""

    width: int
    height: int
    num_inference_steps: int
    true_cfg_scale: float
    true_cfg: bool  # a negative prompt is given and the scale is above 1: two branches per step
    num_images_per_prompt: int = 1
    max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH
    preset: str | None = None

    @property
    def megapixels(self) -> float:
        return self.width * self.height / 1e6


@dataclass
class BatchRequest:
    """One request's own values; `branches` is its conditioning once `encode` has run."""

    prompt: str
    negative_prompt: str | None
    seed: int
    branches: list[Conditioning] | None = None

    @property
    def signature(self) -> tuple:
        """The conditioning shapes: requests batch together only when theirs are equal."""
        if self.branches is None:
            raise ValueError("signature of a request that is not encoded yet")
        return tuple(
            (tuple(b.embeds.shape), None if b.mask is None else tuple(b.mask.shape)) for b in self.branches
        )


@dataclass(frozen=True)
class BatchPlan:
    """How many requests a batch holds: at most `max_images` image rows per step, and within
    `memory_bytes` (None: no memory bound) at STEP_BYTES_PER_MEGAPIXEL."""

    max_images: int = 1
    memory_bytes: int | None = None

    def slots(self, settings: BatchSettings) -> int:
        """Requests per batch for `settings`: the same for every batch of these settings (fixed shapes)."""
        rows = self.max_images
        if self.memory_bytes is not None:
            rows = min(rows, int(self.memory_bytes // (settings.megapixels * STEP_BYTES_PER_MEGAPIXEL)))
        return max(1, rows // settings.num_images_per_prompt)

    @classmethod
    def for_device(cls, device: torch.device, max_images: int, share: float = 0.8) -> "BatchPlan":
        """`max_images` rows, bounded on CUDA by `share` of the memory free now (after loading)."""
        if device.type != "cuda":
            return cls(max_images)
        free, _ = torch.cuda.mem_get_info(device)
        return cls(max_images, int(free * share))


def encode(pipe, request: BatchRequest, settings: BatchSettings) -> float:
    """Encode `request` alone, as `Pipeline.generate` encodes one prompt (its branches repeated per image);
    returns the seconds it took."""
    timer = _StageTimer(pipe.device)
    n, length = settings.num_images_per_prompt, settings.max_sequence_length
    branches = [pipe.encode([request.prompt], length, n)]
    if settings.true_cfg:
        branches.append(pipe.encode([request.negative_prompt], length, n))
    request.branches = branches
    timer.lap("text_encoding")
    return timer.total


def run_batch(
    pipe, requests: list[BatchRequest], settings: BatchSettings, slots: int, on_step=None
) -> tuple[list[list[PIL.Image.Image]], dict[str, float]]:
    """Denoise encoded `requests` (equal signatures) as one batch of `slots` requests and decode each alone.
    Returns each request's images and the seconds spent denoising and decoding."""
    if not 1 <= len(requests) <= slots:
        raise ValueError(f"{len(requests)} requests for a batch of {slots}")
    padded = requests + [requests[0]] * (slots - len(requests))
    branches = [_stack([r.branches[i] for r in padded]) for i in range(len(requests[0].branches))]
    preset = get_preset(settings.preset)
    scheduler = None if preset is None else preset.make_scheduler()
    canvas = pipe.model.canvas(settings.width, settings.height)
    seeds = [r.seed for r in padded]
    timer = _StageTimer(pipe.device)
    steps, scale = settings.num_inference_steps, settings.true_cfg_scale
    latents = pipe.denoise(branches, canvas, steps, scale, seeds, on_step, False, scheduler)
    timer.lap("denoising")
    rows = settings.num_images_per_prompt
    images = [pipe.model.decode(latents[i * rows : (i + 1) * rows], canvas) for i in range(len(requests))]
    timer.lap("decoding")
    return images, timer.timings


def _stack(parts: list[Conditioning]) -> Conditioning:
    embeds = torch.cat([p.embeds for p in parts])
    if all(p.mask is None for p in parts):
        return Conditioning(embeds, None)
    return Conditioning(embeds, torch.cat([p.mask for p in parts]))
