"""Text-to-image pipeline: prompt encoding, the flow-matching denoise loop with true CFG, VAE decoding.

It reproduces diffusers' `QwenImagePipeline` step for step (same seeds, schedule, CFG rescale and
decoding), so with `variant="reference"` its pixels equal diffusers' on the same weights.
"""

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import PIL.Image
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.image_processor import VaeImageProcessor

from models.components import Components, load_components
from models.embedded import EMBEDDED_NAME, build_embedded_components
from models.errors import InputError
from models.lora import LoraFile, MergeReport
from models.math import unpack_latents
from models.prompt_template import DEFAULT_SEQUENCE_LENGTH
from models.text_encoder import encode_prompts
from pipelines import lora
from pipelines.cuda_graph import GraphedStep, cuda_graphs_enabled_by_env, cut_collectives_by_env
from pipelines.limits import DEFAULT_TRUE_CFG_SCALE, VARIANTS, as_prompt_list, check_generation_args
from pipelines.parallel import ParallelPlan, Ranks, join_ranks, resolve_plan
from pipelines.presets import get_preset
from pipelines.sampling import (
    Conditioning,
    Step,
    branch_velocities,
    euler_loop,
    flow_timesteps,
    initial_noise,
    latent_size,
    true_cfg,
)

BF16_VARIANTS = VARIANTS[:2]
FP8_VARIANTS = VARIANTS[2:]
DEFAULT_SAMPLE_SIZE = 128  # latent cells per side by default, as diffusers' pipeline (1024 px at 8x)


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults a model suggests: full size for real checkpoints, small and quick for the embedded one."""

    width: int = 1024
    height: int = 1024
    num_inference_steps: int = 50
    true_cfg_scale: float = DEFAULT_TRUE_CFG_SCALE


EMBEDDED_DEFAULTS = GenerationDefaults(width=256, height=256, num_inference_steps=20)


def checkpoint_defaults(vae_scale_factor: int) -> GenerationDefaults:
    """A checkpoint's defaults: diffusers' default sample size times the VAE scale, 1024 px for Qwen-Image."""
    side = DEFAULT_SAMPLE_SIZE * vae_scale_factor
    return GenerationDefaults(width=side, height=side)


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
    preset: str = ""
    loras: str = ""  # the LoRAs that ran, with scales and mode ("" without LoRA)

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
        self.vae_scale_factor = components.vae_scale_factor
        self.size_multiple = 2 * self.vae_scale_factor  # one latent cell per side after 2x2 packing
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.size_multiple)
        self.last_run: RunInfo | None = None
        self.cuda_graphs = device.type == "cuda" and cuda_graphs_enabled_by_env()
        self._graphed = GraphedStep(self._eager_step, cut_collectives=cut_collectives_by_env())
        self.ranks: Ranks | None = None  # this process's part in a parallel plan (pipelines/parallel.py)
        self.loras: dict[str, lora.LoadedLora] = {}
        self.lora_mode = "branch"
        self.lora_merge: MergeReport | None = None
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
        defaults = checkpoint_defaults(components.vae_scale_factor)
        return cls(components, str(directory), device, dtype, defaults, variant)

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
        self.lora_merge = lora.sync_loras(self, variant)  # branch or merge LoRAs before the gate reads them
        if self.transformer.is_fp8:
            report = self.transformer.post_load_weights(fuse=variant == "fp8-fused")
            variant = "fp8-fused" if report.fused else "fp8-unfused"  # e.g. QWEN_IMAGE_FP8_FUSION=0
        else:
            self.transformer.set_numerics(variant)
        self._graphed.graphs.clear()
        self.variant = variant

    def load_lora(self, path: str | Path | LoraFile, scale: float = 1.0, name: str | None = None) -> str:
        """Mount a LoRA file (any layout diffusers reads for Qwen-Image) at `scale`; returns its name.
        Several LoRAs stack; the base weights are never reloaded (pipelines/lora.py)."""
        name = lora.load_lora(self, path, scale, name)
        self.set_variant(self.variant)
        return name

    def set_lora_scales(self, scales: dict[str, float]) -> None:
        """Change the scales of loaded LoRAs, by name (the same scales again change nothing)."""
        if lora.set_lora_scales(self, scales):
            self.set_variant(self.variant)

    def unload_lora(self, name: str | None = None) -> None:
        """Remove one LoRA (all with None); the layers it touched get their original weights back."""
        lora.unload_lora(self, name)
        self.set_variant(self.variant)

    def set_lora_mode(self, mode: str) -> None:
        """'branch' (LoRA beside each layer; FP8 stays fused with dual output) or 'merge' (folded into the
        weights: no extra GEMMs; FP8 weights requantized, originals kept on the host)."""
        self.lora_mode = lora.check_lora_mode(mode)
        self.set_variant(self.variant)

    def set_parallel(self, plan: ParallelPlan | None) -> None:
        """Share each image with the other ranks as `plan` says (None: this process alone). Every rank
        calls it at the same point; captured graphs are dropped."""
        if self.ranks is not None:
            self.ranks.release()
        self.ranks = None if plan is None or plan.world_size == 1 else Ranks(plan, self.transformer)
        self._graphed.graphs.clear()

    def parallel_summary(self) -> str:
        """The parallel plan this process runs in, e.g. "CFG-2 x Ulysses-1 on 2 ranks (this is rank 0)"."""
        return "one process" if self.ranks is None else self.ranks.describe()

    def fusion_summary(self) -> str:
        """The fusion report: fused FP8 producer paths and why the others are not."""
        if not self.transformer.is_fp8:
            return "FP8 norm+quant fusion: off (BF16 weights)"
        return self.transformer.fusion_report.summary()

    def encode(self, prompts: list[str], max_sequence_length: int, copies: int = 1) -> Conditioning:
        """Prompt embeddings and padding mask, each prompt repeated `copies` times in a row."""
        c = self.components
        embeds, mask = encode_prompts(
            c.text_encoder, c.tokenizer, prompts, self.device, self.dtype, max_sequence_length
        )
        return Conditioning(embeds, mask).repeat(copies)

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
        preset: str | None = None,
        lora_scales: dict[str, float] | None = None,
    ) -> list[PIL.Image.Image]:
        """Generate images; see docs/API.md. Details of the run land in `self.last_run`."""
        prompts = as_prompt_list(prompt, "prompt")
        negatives = as_prompt_list(negative_prompt, "negative_prompt")
        run_preset = get_preset(preset)
        suggested = run_preset or self.defaults  # a preset's steps and CFG scale, else the model's
        width = self.defaults.width if width is None else width
        height = self.defaults.height if height is None else height
        steps = suggested.num_inference_steps if num_inference_steps is None else num_inference_steps
        true_cfg_scale = suggested.true_cfg_scale if true_cfg_scale is None else true_cfg_scale
        check_generation_args(
            prompts,
            negatives,
            width,
            height,
            steps,
            true_cfg_scale,
            num_images_per_prompt,
            max_sequence_length,
            seed,
            self.size_multiple,
        )
        if lora_scales:
            self.set_lora_scales(lora_scales)
        scheduler = self.components.scheduler if run_preset is None else run_preset.make_scheduler()
        if seed is None:
            seed = random.randrange(2**31)
            if self.ranks is not None:
                seed = self.ranks.share_seed(seed)
        timer = _StageTimer(self.device)

        branches = [self.encode(prompts, max_sequence_length, num_images_per_prompt)]
        if negatives is not None and true_cfg_scale > 1:
            negatives = negatives * len(prompts) if len(negatives) == 1 else negatives
            branches.append(self.encode(negatives, max_sequence_length, num_images_per_prompt))
        timer.lap("text_encoding")

        latents = self.denoise(
            branches, width, height, steps, true_cfg_scale, seed, on_step, progress, scheduler=scheduler
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
            preset=preset or "",
            loras=lora.lora_summary(self),
        )
        return images

    def denoise(
        self,
        branches: list[Conditioning],
        width: int,
        height: int,
        steps: int,
        true_cfg_scale: float,
        seed: int,
        on_step: Callable[[int, int], None] | None = None,
        progress: bool = False,
        scheduler: FlowMatchEulerDiscreteScheduler | None = None,
    ) -> torch.Tensor:
        """The flow-matching Euler loop from seeded noise; `branches` is [positive] or [positive, negative]
        (true CFG); `scheduler` defaults to the checkpoint's. Returns packed latents [B, tokens, 4 * C]."""
        latent_hw = latent_size(width, height, self.vae_scale_factor)
        batch = branches[0].embeds.shape[0]
        c = self.components
        scheduler = c.scheduler if scheduler is None else scheduler
        latents = initial_noise(batch, c.latent_channels, latent_hw, seed, self.device, self.dtype)
        timesteps = flow_timesteps(scheduler, steps, latents.shape[1], self.device)
        step = self._step((1, latent_hw[0] // 2, latent_hw[1] // 2))

        def velocity(latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            cfg = None if self.ranks is None else self.ranks.cfg
            velocities = branch_velocities(step, latents, sigma, branches, cfg)
            return velocities[0] if len(velocities) == 1 else true_cfg(*velocities, true_cfg_scale)

        return euler_loop(scheduler, timesteps, latents, velocity, on_step, progress)

    def _eager_step(
        self,
        latents: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        sigma: torch.Tensor,
        grid: tuple[int, int, int],
    ) -> torch.Tensor:
        return self.transformer(latents, embeds, mask, sigma, grid)

    def _step(self, grid: tuple[int, int, int]) -> Step:
        """The transformer call for one latent grid: CUDA-graph replays on CUDA, eager elsewhere."""
        if not self.cuda_graphs:
            return lambda latents, c, sigma: self._eager_step(latents, c.embeds, c.mask, sigma, grid)
        return lambda latents, c, sigma: self._graphed(latents, c.embeds, c.mask, sigma, static=(grid,))

    def decode(self, latents: torch.Tensor, width: int, height: int) -> list[PIL.Image.Image]:
        """VAE-decode packed latents to PIL images (the VAE config's latent statistics)."""
        vae = self.components.vae
        z = unpack_latents(latents, *latent_size(width, height, self.vae_scale_factor)).to(vae.dtype)
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
    parallel: ParallelPlan | str | None = None,
) -> QwenImagePipeline:
    """A new pipeline for `model` (None: the embedded default). `parallel` ("auto" or a ParallelPlan)
    makes this process one rank of a launched group; a plan that does not fit is refused before loading."""
    plan = resolve_plan(parallel, model)
    device = pick_device(device)
    if plan is not None:
        device = join_ranks(device)
    pipe = QwenImagePipeline.from_pretrained(model, variant=variant, device=device, dtype=dtype)
    if plan is not None:
        pipe.set_parallel(plan)
    return pipe


def generate(
    prompt: str | list[str],
    model: str | Path | None = None,
    variant: str = "auto",
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    parallel: ParallelPlan | str | None = None,
    **kwargs,
) -> list[PIL.Image.Image]:
    """One-call generation; keeps one pipeline per (model, variant, device, dtype, parallel) to reuse."""
    key = (str(model), variant, str(pick_device(device)), pick_dtype(dtype), parallel)
    if key not in _CACHE:
        _CACHE[key] = load_pipeline(model, variant, device, dtype, parallel)
    return _CACHE[key].generate(prompt, **kwargs)
