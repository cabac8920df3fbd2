"""The narrow seam between the transformer blocks and the norm/modulate/residual backends.

Blocks call only these functions; the numerics mode picks diffusers' op-for-op arithmetic
(`reference`) or the DESIGN §4 rounding contract (`contract`, Triton on CUDA, torch twin elsewhere).
"""

from enum import StrEnum

import torch

from kernels.norm_modulate import gated_residual_torch as gated_residual
from kernels.norm_modulate import layer_norm_modulate_torch as layer_norm_modulate
from kernels.reference import gated_residual_reference, layer_norm_modulate_reference


class Numerics(StrEnum):
    REFERENCE = "reference"
    CONTRACT = "contract"


def norm_modulate(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, numerics: Numerics
) -> torch.Tensor:
    """`modulate(LN(x), shift, scale)` in BF16 (or the model dtype)."""
    if numerics is Numerics.REFERENCE or x.dtype != torch.bfloat16:
        return layer_norm_modulate_reference(x, shift, scale, eps)
    y, _ = layer_norm_modulate(x, shift, scale, eps)
    return y


def residual_add(residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, numerics: Numerics) -> torch.Tensor:
    """`residual + gate * x`."""
    if numerics is Numerics.REFERENCE or x.dtype != torch.bfloat16:
        return gated_residual_reference(residual, gate, x)
    return gated_residual(residual, gate, x)
