"""LayerNorm + AdaLN modulate producers (and the gated residual before them): torch twins of DESIGN §4.

Every function follows the rounding contract: fp32 math, one bf16 rounding per written tensor, no FMA
contraction (each torch op rounds on its own), IEEE sqrt and division. `shift`, `scale` and `gate` are
per sample, shaped [B, D]; activations are [B, L, D].
"""

import torch

from kernels.quant import static_quant_fp8_torch


def layer_norm_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`bf16(x_hat)`: LayerNorm without affine in fp32, rounded once."""
    xf = x.float()
    width = xf.shape[-1]
    mean = xf.sum(-1, keepdim=True) / width
    centered = xf - mean
    var = (centered * centered).sum(-1, keepdim=True) / width
    rstd = 1.0 / torch.sqrt(var + eps)
    return (centered * rstd).to(x.dtype)


def modulate_torch(normed: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`bf16(fp32(n) * (1 + fp32(scale)) + fp32(shift))`, each fp32 op rounded on its own."""
    one_plus_scale = 1.0 + scale.float().unsqueeze(1)
    return (normed.float() * one_plus_scale + shift.float().unsqueeze(1)).to(normed.dtype)


def gated_residual_torch(residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`bf16(fp32(residual) + fp32(gate) * fp32(x))`, no FMA, one rounding."""
    return (residual.float() + gate.float().unsqueeze(1) * x.float()).to(residual.dtype)


def layer_norm_modulate_torch(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Producer 1: `y = modulate(LN(x))`; with `inv_scale`, also its FP8 quantization `q`.

    Returns `(y, q)`; `y` is None when `write_y` is False, `q` is None without `inv_scale`.
    """
    y = modulate_torch(layer_norm_torch(x, eps), shift, scale)
    q = None if inv_scale is None else static_quant_fp8_torch(y, inv_scale)
    return (y if write_y else None), q


def gated_residual_layer_norm_modulate_torch(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Producer 2: `r = residual + gate * x; y = modulate(LN(r))`; returns `(r, y, q)` like producer 1."""
    r = gated_residual_torch(residual, gate, x)
    y, q = layer_norm_modulate_torch(r, shift, scale, eps, inv_scale, write_y)
    return r, y, q
