"""Text-to-image pipeline: prompt encoding, the flow-matching denoise loop with true CFG, VAE decoding.

It reproduces diffusers' `QwenImagePipeline` step for step (same seeds, schedule, CFG rescale and
decoding), so with `variant="reference"` its pixels equal diffusers' on the same weights.
"""

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor
from tqdm.auto import tqdm

from models.components import Components, load_components
from models.embedded import EMBEDDED_NAME, build_embedded_components
from models.errors import InputError
from models.math import pack_latents, unpack_latents
from models.text_encoder import DEFAULT_SEQUENCE_LENGTH, MAX_SEQUENCE_LENGTH, encode_prompts
from pipelines.cuda_graph import GraphedStep, cuda_graphs_enabled_by_env
from pipelines.limits import MAX_IMAGES, VARIANTS, check_size, check_steps

BF16_VARIANTS = VARIANTS[:2]
FP8_VARIANTS = VARIANTS[2:]
VAE_SCALE = 8


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults a model suggests: full size for real checkpoints, small and quick for the embedded one."""

    width: int = 1024
    height: int = 1024
    num_inference_steps: int = 50
    true_cfg_scale: float = 4.0


EMBEDDED_DEFAULTS = GenerationDefaults(width=256, height=256, num_inference_steps=20)


@dataclass
class RunInfo:
    """What the last `generate` call did: seed, size, variant and seconds per stage."""

    seed: int
    width: int
    height: int
    num_inference_steps: int
    variant: str
    fusion_summary: str
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ms_per_step(self) -> float:
        return 1000.0 * self.timings.get("denoising", 0.0) / max(self.num_inference_steps, 1)


def pick_device(device: str | torch.device | None) -> torch.device:
    """CUDA when available (or asked for), else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was requested but CUDA is not available on this machine")
    return device


def pick_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """bf16 by default; 'fp32'/'float32' for exact-arithmetic debugging."""
    names = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in names.values():
        return dtype
    if isinstance(dtype, str) and dtype in names:
        return names[dtype]
    raise InputError(f"unsupported dtype {dtype!r}: use bf16 or fp32")


def _as_list(value: str | list[str] | None, name: str) -> list[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(p, str) for p in items):
        raise InputError(f"{name} must be a string or a non-empty list of strings")
    return items


def check_generation_args(
    prompts: list[str] | None,
    width: int,
    height: int,
    steps: int,
    true_cfg_scale: float,
    num_images_per_prompt: int,
    max_sequence_length: int,
    seed: int | None,
) -> None:
    """Raise InputError naming the first invalid argument."""
    if not prompts or any(not p.strip() for p in prompts):
        raise InputError("prompt is empty: describe the image to generate")
    check_size(width, height)
    check_steps(steps)
    if not math.isfinite(true_cfg_scale) or true_cfg_scale < 0:
        raise InputError(f"true_cfg_scale {true_cfg_scale} must be a finite number >= 0")
    if not isinstance(num_images_per_prompt, int) or not 1 <= num_images_per_prompt <= MAX_IMAGES:
        raise InputError(f"num_images_per_prompt {num_images_per_prompt} must be between 1 and {MAX_IMAGES}")
    if not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise InputError(
            f"max_sequence_length {max_sequence_length} must be between 1 and {MAX_SEQUENCE_LENGTH}"
        )
    if seed is not None and (not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise InputError(f"seed {seed} must be an integer in [0, 2**63)")


class QwenImagePipeline:
    """Qwen-Image text-to-image on one device; the variant picks numerics and FP8 fusion on shared weights."""

    def __init__(
        self,
        components: Components,
        model_name: str,
        device: torch.device,
        dtype: torch.dtype,
        defaults: GenerationDefaults,
        variant: str = "auto",
    ) -> None:
        self.components = components
        self.model_name = model_name
        self.device = device
        self.dtype = dtype
        self.defaults = defaults
        self.image_processor = VaeImageProcessor(vae_scale_factor=VAE_SCALE * 2)
        self.last_run: RunInfo | None = None
        self.cuda_graphs = device.type == "cuda" and cuda_graphs_enabled_by_env()
        self._graphed = GraphedStep(self._eager_step)
        self.variant = ""
        self.set_variant(variant)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path | None = None,
        variant: str = "auto",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> "QwenImagePipeline":
        """Load a local diffusers-layout checkpoint, or build the embedded default (`directory` None)."""
        device, dtype = pick_device(device), pick_dtype(dtype)
        if directory is None:
            components = build_embedded_components(dtype, device)
            return cls(components, EMBEDDED_NAME, device, dtype, EMBEDDED_DEFAULTS, variant)
        components = load_components(Path(directory), dtype, device)
        return cls(components, str(directory), device, dtype, GenerationDefaults(), variant)

    @property
    def transformer(self):
        return self.components.transformer

    def available_variants(self) -> list[str]:
        """Variants these weights can run: FP8 ones for a ModelOpt FP8 checkpoint, BF16 ones otherwise."""
        return list(FP8_VARIANTS if self.transformer.is_fp8 else BF16_VARIANTS)

    def set_variant(self, variant: str) -> None:
        """Switch numerics or FP8 fusion in place (re-running the gate); 'auto' picks the fastest path."""
        available = self.available_variants()
        if variant == "auto":
            variant = available[-1]
        if variant not in available:
            raise InputError(f"variant {variant!r} is not available for this model; choose from {available}")
        if self.transformer.is_fp8:
            report = self.transformer.post_load_weights(fuse=variant == "fp8-fused")
            variant = "fp8-fused" if report.fused else "fp8-unfused"  # e.g. QWEN_IMAGE_FP8_FUSION=0
        else:
            self.transformer.set_numerics(variant)
        self._graphed.graphs.clear()
        self.variant = variant

    def fusion_summary(self) -> str:
        """The fusion report: fused FP8 producer paths and why the others are not."""
        if not self.transformer.is_fp8:
            return "FP8 norm+quant fusion: off (BF16 weights)"
        return self.transformer.fusion_report.summary()

    def encode(
        self, prompts: list[str], max_sequence_length: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt embeddings [B, L, H] and padding mask (None when nothing is padded)."""
        c = self.components
        return encode_prompts(
            c.text_encoder, c.tokenizer, prompts, self.device, self.dtype, max_sequence_length
        )

    @torch.no_grad()
    def generate(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        width: int | None = None,
        height: int | None = None,
        num_inference_steps: int | None = None,
        true_cfg_scale: float | None = None,
        seed: int | None = None,
        num_images_per_prompt: int = 1,
        max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
        on_step: Callable[[int, int], None] | None = None,
        progress: bool = False,
    ) -> list[PIL.Image.Image]:
        """Generate images; see docs/API.md. Details of the run land in `self.last_run`."""
        prompts = _as_list(prompt, "prompt")
        negatives = _as_list(negative_prompt, "negative_prompt")
        width = self.defaults.width if width is None else width
        height = self.defaults.height if height is None else height
        steps = self.defaults.num_inference_steps if num_inference_steps is None else num_inference_steps
        true_cfg_scale = self.defaults.true_cfg_scale if true_cfg_scale is None else true_cfg_scale
        check_generation_args(
            prompts, width, height, steps, true_cfg_scale, num_images_per_prompt, max_sequence_length, seed
        )
        if negatives is not None and len(negatives) not in (1, len(prompts)):
            raise InputError(
                f"{len(negatives)} negative prompts for {len(prompts)} prompts: give one or one each"
            )
        seed = random.randrange(2**31) if seed is None else seed
        do_cfg = negatives is not None and true_cfg_scale > 1
        timer = _StageTimer(self.device)

        embeds, mask = self._encode_repeated(prompts, num_images_per_prompt, max_sequence_length)
        neg_embeds = neg_mask = None
        if do_cfg:
            negatives = negatives * len(prompts) if len(negatives) == 1 else negatives
            neg_embeds, neg_mask = self._encode_repeated(
                negatives, num_images_per_prompt, max_sequence_length
            )
        timer.lap("text_encoding")

        latents = self.denoise(
            embeds, mask, neg_embeds, neg_mask, width, height, steps, true_cfg_scale, seed, on_step, progress
        )
        timer.lap("denoising")
        images = self.decode(latents, width, height)
        timer.lap("decoding")
        self.last_run = RunInfo(
            seed,
            width,
            height,
            steps,
            self.variant,
            self.fusion_summary(),
            timer.timings | {"total": timer.total},
        )
        return images

    def _encode_repeated(
        self, prompts: list[str], copies: int, max_sequence_length: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        embeds, mask = self.encode(prompts, max_sequence_length)
        batch, seq, _ = embeds.shape
        embeds = embeds.repeat(1, copies, 1).view(batch * copies, seq, -1)
        if mask is not None:
            mask = mask.repeat(1, copies).view(batch * copies, seq)
        return embeds, mask

    def denoise(
        self,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        neg_embeds: torch.Tensor | None,
        neg_mask: torch.Tensor | None,
        width: int,
        height: int,
        steps: int,
        true_cfg_scale: float,
        seed: int,
        on_step: Callable[[int, int], None] | None = None,
        progress: bool = False,
    ) -> torch.Tensor:
        """The flow-matching Euler loop; returns packed latents [B, tokens, 64]."""
        lat_h, lat_w = 2 * (height // (VAE_SCALE * 2)), 2 * (width // (VAE_SCALE * 2))
        batch = embeds.shape[0]
        generator = torch.Generator("cpu").manual_seed(seed)
        noise = randn_tensor(
            (batch, 1, 16, lat_h, lat_w), generator=generator, device=self.device, dtype=self.dtype
        )
        latents = pack_latents(noise[:, 0])
        grid = (1, lat_h // 2, lat_w // 2)

        scheduler = self.components.scheduler
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            latents.shape[1],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        step = self._step(grid)
        for i, t in enumerate(tqdm(timesteps, desc="denoising", disable=not progress, leave=False)):
            sigma = t.expand(batch).to(latents.dtype) / 1000
            velocity = step(latents, embeds, mask, sigma)
            if neg_embeds is not None:
                neg_velocity = step(latents, neg_embeds, neg_mask, sigma)
                combined = neg_velocity + true_cfg_scale * (velocity - neg_velocity)
                cond_norm = torch.norm(velocity, dim=-1, keepdim=True)
                combined_norm = torch.norm(combined, dim=-1, keepdim=True)
                velocity = combined * (cond_norm / combined_norm)
            latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
            if on_step is not None:
                on_step(i + 1, len(timesteps))
        return latents

    def _eager_step(
        self,
        latents: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        sigma: torch.Tensor,
        grid: tuple[int, int, int],
    ) -> torch.Tensor:
        return self.transformer(latents, embeds, mask, sigma, grid)

    def _step(self, grid: tuple[int, int, int]) -> Callable[..., torch.Tensor]:
        """The transformer call for one latent grid: CUDA-graph replays on CUDA, eager elsewhere."""
        if not self.cuda_graphs:
            return lambda *tensors: self._eager_step(*tensors, grid)
        return lambda *tensors: self._graphed(*tensors, static=(grid,))

    def decode(self, latents: torch.Tensor, width: int, height: int) -> list[PIL.Image.Image]:
        """VAE-decode packed latents to PIL images (DESIGN §2 latent statistics)."""
        vae = self.components.vae
        lat_h, lat_w = 2 * (height // (VAE_SCALE * 2)), 2 * (width // (VAE_SCALE * 2))
        z = unpack_latents(latents, lat_h, lat_w).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        z = z / inv_std + mean
        pixels = vae.decode(z, return_dict=False)[0][:, :, 0]
        return self.image_processor.postprocess(pixels, output_type="pil")


class _StageTimer:
    """Wall-clock seconds per stage, synchronizing CUDA so each lap is real."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.timings: dict[str, float] = {}
        self.start = self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.timings[name] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


_CACHE: dict[tuple, QwenImagePipeline] = {}


def load_pipeline(
    model: str | Path | None = None,
    variant: str = "auto",
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> QwenImagePipeline:
    """A new pipeline for `model` (None: the embedded default)."""
    return QwenImagePipeline.from_pretrained(model, variant=variant, device=device, dtype=dtype)


def generate(
    prompt: str | list[str],
    model: str | Path | None = None,
    variant: str = "auto",
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    **kwargs,
) -> list[PIL.Image.Image]:
    """One-call generation; keeps one pipeline per (model, variant, device, dtype) for later calls."""
    key = (str(model), variant, str(pick_device(device)), pick_dtype(dtype))
    if key not in _CACHE:
        _CACHE[key] = load_pipeline(model, variant, device, dtype)
    return _CACHE[key].generate(prompt, **kwargs)
