"""diffusers' numerics, op for op: the `reference` mode of the producer seam.

Each line mirrors `QwenImageTransformerBlock` / `AdaLayerNormContinuous` in diffusers, so every
intermediate is rounded to the activation dtype exactly where diffusers rounds it.
"""

import torch
import torch.nn.functional as F


def layer_norm_modulate_reference(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> torch.Tensor:
    """`LN(x) * (1 + scale) + shift` in the activation dtype, as diffusers' `_modulate`."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def gated_residual_reference(residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`residual + gate * x` in the activation dtype."""
    return residual + gate.unsqueeze(1) * x
