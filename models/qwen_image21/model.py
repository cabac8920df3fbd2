"""A loaded Qwen-Image 2.1 checkpoint as the family-neutral pipeline drives it.

Each hook follows diffusers 0.42's `QwenImage21Pipeline` op for op: prompts (and condition images) encoded by
Qwen3-VL, condition images VAE-encoded once per request, seeded noise packed unpatched, the sampling grid
(the Turbo checkpoint's `sample_sigmas`), the transformer's target velocity, plain true CFG
(`neg + s * (cond - neg)`, no norm rescale) and decoding. With `variant="reference"` its pixels equal
diffusers' on the same weights, with the KV cache (`use_kv_cache`, default on) or without, each against
diffusers with the same setting. The steps themselves: steps.py.
"""

from pathlib import Path

import numpy as np
import PIL.Image
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.torch_utils import randn_tensor

from qwen_image_fusion.models.env import env_flag
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import (
    Decoded,
    FamilyModel,
    GenerationDefaults,
    StepCall,
    calculate_dimensions,
    parameter_summary,
)
from qwen_image_fusion.models.pixels import pil_images
from qwen_image_fusion.models.qwen_image21.checkpoint import KV_CACHE_ENV, OUTPUT_RESOLUTION, VAE_SCALE
from qwen_image_fusion.models.qwen_image21.components import (
    Components21,
    load_components21,
    save_components21,
)
from qwen_image_fusion.models.qwen_image21.conditioning import (
    ConditionImages,
    encode_condition_latents,
    encode_prompts21,
    pack_unpatched,
    prepare_condition_images,
    system_tokens,
    unpack_unpatched,
)
from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION
from qwen_image_fusion.models.qwen_image21.steps import Conditioning21, RequestSteps, StepPlanner
from qwen_image_fusion.models.vae_decode import DecodeReport, tiles


class QwenImage21Model(FamilyModel):
    """2.1's components on one device, with the hooks of the shared pipeline.

    `use_kv_cache` (default on; QWEN_IMAGE_KV_CACHE=0 turns it off) is diffusers' flag of the same name: the
    text and condition-image keys and values are computed on the first step and reused. `resolution` is
    diffusers' `output_resolution`: the default side without condition images, and the area condition images
    are resized to (and the output's with them).
    """

    quantization = QUANTIZATION
    vae_scale_factor = VAE_SCALE

    def __init__(self, components: Components21, device: torch.device, dtype: torch.dtype) -> None:
        self.components = components
        self.transformer = components.transformer
        self.device, self.dtype = device, dtype
        self.resolution = OUTPUT_RESOLUTION
        self.image_processor = VaeImageProcessor(
            vae_scale_factor=VAE_SCALE, vae_latent_channels=components.vae.config.z_dim
        )
        self.drop_tokens = system_tokens(components.processor)
        self.planner = StepPlanner(self.transformer, dtype)
        self.planner.use_kv_cache = env_flag(KV_CACHE_ENV)
        self._prepared: tuple[list[PIL.Image.Image], ConditionImages] | None = None

    @classmethod
    def load(
        cls,
        directory: Path,
        dtype: torch.dtype,
        device: torch.device,
        vae_dtype: torch.dtype,
        sample_sigmas: tuple[float, ...] | None,
    ) -> "QwenImage21Model":
        return cls(load_components21(directory, dtype, device, vae_dtype, sample_sigmas), device, dtype)

    @property
    def use_kv_cache(self) -> bool:
        return self.planner.use_kv_cache

    @use_kv_cache.setter
    def use_kv_cache(self, on: bool) -> None:
        self.planner.use_kv_cache = on

    def condition_images(self, images: list[PIL.Image.Image]) -> ConditionImages:
        """The request's images prepared once (encode runs per CFG branch, canvas once: one list object)."""
        if self._prepared is None or self._prepared[0] is not images:
            prepared = prepare_condition_images(images, self.resolution, self.image_processor)
            self._prepared = (images, prepared)
        return self._prepared[1]

    def encode(
        self, prompts: list[str], max_sequence_length: int, images: list[PIL.Image.Image] | None = None
    ) -> Conditioning21:
        c = self.components
        prepared = self.condition_images(images) if images else None
        vision = [] if prepared is None else prepared.vision
        embeds, mask, slots = encode_prompts21(
            c.text_encoder, c.processor, prompts, vision, self.drop_tokens, self.device, self.dtype
        )
        if prepared is not None:
            self._check_vision_tokens(prepared, int(slots[0].sum()))
        return Conditioning21(embeds, mask, slots)

    def prompt_tokens(self, prompts: list[str]) -> int:
        """2.1 keeps every token of a prompt (diffusers' pipeline has no max_sequence_length)."""
        return max(len(ids) for ids in self.components.tokenizer(prompts).input_ids)

    def _check_vision_tokens(self, prepared: ConditionImages, found: int) -> None:
        """InputError unless the processor kept each condition image's size: one vision token per 32x32
        pixels, each standing for the 2x2 latent tokens of the same pixels (the transformer pairs them)."""
        expected = sum(width * height for width, height in prepared.sizes) // (2 * VAE_SCALE) ** 2
        if found != expected:
            limits = self.components.processor.image_processor.size
            raise InputError(
                f"the processor turned the condition images into {found} vision tokens, not {expected}: its "
                f"pixel limits {dict(limits)} resize images of about {self.resolution}x{self.resolution}"
            )

    def canvas(
        self, width: int, height: int, images: list[PIL.Image.Image] | None = None, prompts: int = 1
    ) -> RequestSteps:
        rows, columns = 2 * (height // (2 * VAE_SCALE)), 2 * (width // (2 * VAE_SCALE))
        if not images:
            return RequestSteps(rows, columns, None)
        pixels = self.condition_images(images).pixels
        condition, grids = encode_condition_latents(self.components.vae, pixels, self.dtype)
        return RequestSteps(rows, columns, condition.to(self.device), grids)

    def default_size(self, images: list[PIL.Image.Image]) -> tuple[int, int]:
        """The last condition image's aspect at `resolution`^2 pixels (multiples of 32), as diffusers."""
        return calculate_dimensions(self.resolution**2, images[-1].width / images[-1].height)

    def sigmas(self, steps: int) -> np.ndarray:
        """The Turbo checkpoint's `sample_sigmas` when `steps` is their count; else linspace(1, 1/steps)."""
        grid = self.components.sample_sigmas
        if grid is not None and len(grid) == steps:
            return np.array(grid)
        return super().sigmas(steps)

    def initial_latents(self, canvas: RequestSteps, batch: int, seed: int) -> torch.Tensor:
        """Seeded noise [B, 1, z, H, W] from a CPU generator, packed unpatched (as `prepare_latents`)."""
        channels = self.transformer.config.in_channels
        shape = (batch, 1, channels, canvas.height, canvas.width)
        generator = torch.Generator("cpu").manual_seed(seed)
        noise = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
        return pack_unpatched(noise.view(batch, channels, 1, canvas.height, canvas.width))

    def step_call(
        self, latents: torch.Tensor, sigma: torch.Tensor, branch: Conditioning21, canvas: RequestSteps
    ) -> StepCall:
        return self.planner.step_call(latents, sigma, branch, canvas)

    def run_step(self, *args) -> torch.Tensor:
        *tensors, step = args
        return step.run(self.transformer, *tensors)

    def keep_step_buffers(self, count: int) -> None:
        """At most `count` KV caches (one per CFG branch and request shape) kept across requests."""
        self.planner.max_slots = count
        self.planner.keep(count)

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        return uncond + scale * (cond - uncond)

    def decode(self, latents: torch.Tensor, canvas: RequestSteps, fast: bool = False) -> Decoded:
        """VAE-decode packed latents (`z * std + mean` with the VAE config's statistics) to PIL images; its
        VAE's convolutions are 2D already, so there is no `fast` form (the spec refuses it)."""
        vae = self.components.vae
        z = unpack_unpatched(latents, canvas.height, canvas.width).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        z = z * std + mean
        pixels = vae.decode(z, return_dict=False)[0][:, :, 0]
        report = DecodeReport(fast=False, tiled=tiles(vae, z))
        return Decoded(pil_images(self.image_processor, pixels), report)

    def describe(self) -> list[str]:
        c = self.components
        cfg = self.transformer.config
        sigmas = c.sample_sigmas
        grid = ""
        if sigmas is not None:
            grid = f"; Turbo grid of {len(sigmas)} sigmas ({', '.join(f'{s:g}' for s in sigmas)})"
        return [
            f"transformer: {parameter_summary(c.transformer)}; {cfg.num_layers} single-stream layers, width "
            f"{cfg.inner_dim}, {cfg.num_attention_heads} heads x {cfg.attention_head_dim}, SwiGLU "
            f"{cfg.mlp_dim}, text dim {cfg.context_in_dim}",
            f"text encoder: {type(c.text_encoder).__name__}, {parameter_summary(c.text_encoder)}",
            f"processor: {type(c.processor).__name__} ({type(c.processor.image_processor).__name__})",
            f"vae: {type(c.vae).__name__}, {parameter_summary(c.vae)}; {c.vae.config.z_dim} latent "
            f"channels, {VAE_SCALE}x scale",
            f"scheduler: {type(c.scheduler).__name__}{grid}",
            f"prefix KV cache: {'on' if self.use_kv_cache and cfg.causal_condition else 'off'}"
            + ("" if cfg.causal_condition else " (the transformer has no causal_condition)"),
        ]

    def save(self, directory: Path, skip: tuple[str, ...], defaults: GenerationDefaults) -> None:
        save_components21(self.components, directory, skip, defaults)
