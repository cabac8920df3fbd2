"""Sampling as free functions: latent geometry, initial noise, the flow-matching schedule, true CFG and the
Euler loop over a velocity callable. Each follows diffusers' `QwenImagePipeline` op for op.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor
from tqdm.auto import tqdm

from models.math import pack_latents
from pipelines.parallel import CfgExchange


@dataclass(frozen=True)
class Conditioning:
    """Prompt embeddings [B, L, H] and their padding mask [B, L] (None when nothing is padded)."""

    embeds: torch.Tensor
    mask: torch.Tensor | None

    def repeat(self, copies: int) -> "Conditioning":
        """Each prompt `copies` times in a row (diffusers' `num_images_per_prompt` order)."""
        batch, seq, _ = self.embeds.shape
        embeds = self.embeds.repeat(1, copies, 1).view(batch * copies, seq, -1)
        mask = None if self.mask is None else self.mask.repeat(1, copies).view(batch * copies, seq)
        return Conditioning(embeds, mask)


# step(latents, conditioning, sigma) -> velocity, one transformer call
Step = Callable[[torch.Tensor, Conditioning, torch.Tensor], torch.Tensor]


def latent_size(width: int, height: int, vae_scale: int) -> tuple[int, int]:
    """(latent height, latent width) of an image, rounded down to even counts for the 2x2 packing."""
    return 2 * (height // (vae_scale * 2)), 2 * (width // (vae_scale * 2))


def initial_noise(
    batch: int,
    channels: int,
    latent_hw: tuple[int, int],
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Packed Gaussian latents [B, H/2*W/2, 4C] drawn as diffusers draws them (seeded CPU generator)."""
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = randn_tensor((batch, 1, channels, *latent_hw), generator=generator, device=device, dtype=dtype)
    return pack_latents(noise[:, 0])


def shift_mu(scheduler: FlowMatchEulerDiscreteScheduler, image_tokens: int) -> float:
    """The dynamic time shift's mu for `image_tokens`, from the scheduler's config as diffusers reads it."""
    config = scheduler.config
    return calculate_shift(
        image_tokens,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def flow_timesteps(
    scheduler: FlowMatchEulerDiscreteScheduler, steps: int, image_tokens: int, device: torch.device
) -> torch.Tensor:
    """Set the scheduler to `steps` sigmas linspace(1, 1/steps) with the dynamic shift for `image_tokens`."""
    sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = shift_mu(scheduler, image_tokens)
    timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    return timesteps


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """`uncond + scale * (cond - uncond)`, rescaled per token to the norm of `cond` (DESIGN §2)."""
    combined = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    combined_norm = torch.norm(combined, dim=-1, keepdim=True)
    return combined * (cond_norm / combined_norm)


def branch_velocities(
    step: Step,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    branches: Sequence[Conditioning],
    cfg: CfgExchange | None = None,
) -> list[torch.Tensor]:
    """One transformer call per CFG branch (positive first), each as its own batch.

    With a CFG exchange of one rank per branch, rank i runs branch i and the velocities are all-gathered:
    the same calls and bytes as one process. A single branch (true CFG off) runs on every rank.
    """
    if cfg is None or len(branches) != cfg.size:
        return [step(latents, branch, sigma) for branch in branches]
    return cfg.gather(step(latents, branches[cfg.rank], sigma))


def euler_loop(
    scheduler: FlowMatchEulerDiscreteScheduler,
    timesteps: torch.Tensor,
    latents: torch.Tensor,
    velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    on_step: Callable[[int, int], None] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Integrate `velocity(latents, sigma)` over the scheduler's timesteps; `on_step(i, n)` after each."""
    batch = latents.shape[0]
    for i, t in enumerate(tqdm(timesteps, desc="denoising", disable=not progress, leave=False)):
        sigma = t.expand(batch).to(latents.dtype) / 1000
        latents = scheduler.step(velocity(latents, sigma), t, latents, return_dict=False)[0]
        if on_step is not None:
            on_step(i + 1, len(timesteps))
    return latents
