"""Sampling as free functions, shared by every family: the flow-matching schedule, the CFG branches
(one transformer call each, or one per CFG rank) and the Euler loop over a velocity callable. Each
follows diffusers' pipelines op for op.
"""

from collections.abc import Callable, Sequence

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from tqdm.auto import tqdm

from qwen_image_fusion.models.family import Conditioning
from qwen_image_fusion.pipelines.parallel import CfgExchange

# step(latents, conditioning, sigma) -> velocity, one transformer call
Step = Callable[[torch.Tensor, Conditioning, torch.Tensor], torch.Tensor]


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
    scheduler: FlowMatchEulerDiscreteScheduler,
    sigmas: np.ndarray,
    image_tokens: int,
    device: torch.device,
    mu: float | None = None,
) -> torch.Tensor:
    """Set the scheduler to `sigmas` with the dynamic shift `mu` (default: the one for `image_tokens`), one
    step per sigma."""
    mu = shift_mu(scheduler, image_tokens) if mu is None else mu
    timesteps, _ = retrieve_timesteps(scheduler, len(sigmas), device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    return timesteps


def strength_timesteps(scheduler: FlowMatchEulerDiscreteScheduler, first_step: int) -> torch.Tensor:
    """The scheduler's timesteps from `first_step` on, where img2img starts (diffusers' `get_timesteps`,
    which sets the scheduler's begin index there)."""
    scheduler.set_begin_index(first_step * scheduler.order)
    return scheduler.timesteps[first_step * scheduler.order :]


def inpaint_blend(
    scheduler: FlowMatchEulerDiscreteScheduler,
    timesteps: torch.Tensor,
    image_latents: torch.Tensor,
    noise: torch.Tensor,
    mask: torch.Tensor,
) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """After step i: the kept part (mask 0) back to the start image, noised to the next timestep (diffusers'
    `QwenImageInpaintPipeline`)."""

    def blend(i: int, latents: torch.Tensor) -> torch.Tensor:
        kept = image_latents
        if i < len(timesteps) - 1:
            kept = scheduler.scale_noise(kept, torch.tensor([timesteps[i + 1]]), noise)
        return (1 - mask) * kept + mask * latents

    return blend


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
    after_step: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Integrate `velocity(latents, sigma)` over the scheduler's timesteps; `after_step(i, latents)` changes
    the latents after each step (inpainting), `on_step(i, n)` reports it."""
    batch = latents.shape[0]
    for i, t in enumerate(tqdm(timesteps, desc="denoising", disable=not progress, leave=False)):
        sigma = t.expand(batch).to(latents.dtype) / 1000
        latents = scheduler.step(velocity(latents, sigma), t, latents, return_dict=False)[0]
        if after_step is not None:
            latents = after_step(i, latents)
        if on_step is not None:
            on_step(i + 1, len(timesteps))
    return latents
