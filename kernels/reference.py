"""diffusers' numerics, op for op: the `reference` mode of the producer seam.

Each line mirrors `QwenImageTransformerBlock` / `AdaLayerNormContinuous` / `RMSNorm` /
`apply_rotary_emb_qwen` in diffusers, so every intermediate is rounded exactly where diffusers rounds it.
"""

import torch
import torch.nn.functional as F


def per_token(mod: torch.Tensor, mod_index: torch.Tensor | None) -> torch.Tensor:
    """Modulation rows [R, D] over the tokens: [B, 1, D] per sample, or [B, L, D] row `mod_index[b, l]` per
    token (the values diffusers' `_modulate` selects with `torch.where(modulate_index == 0, ...)`)."""
    return mod.unsqueeze(1) if mod_index is None else mod[mod_index]


def layer_norm_modulate_reference(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    mod_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """`LN(x) * (1 + scale) + shift` in the activation dtype, as diffusers' `_modulate`."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return normed * (1 + per_token(scale, mod_index)) + per_token(shift, mod_index)


def gated_residual_reference(
    residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, mod_index: torch.Tensor | None = None
) -> torch.Tensor:
    """`residual + gate * x` in the activation dtype."""
    return residual + per_token(gate, mod_index) * x


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers' `RMSNorm`: `x * rsqrt(mean(x^2) + eps)` in fp32, to a half weight's dtype, `* weight`."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return x * weight


def rope_reference(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' `apply_rotary_emb_qwen(use_real=False)`: interleaved pairs of x [B, S, H, D] times complex
    freqs [S, D/2] in complex64."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(1)).flatten(3).type_as(x)


def rms_norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor, rope: torch.Tensor, eps: float
) -> torch.Tensor:
    """Per-head q/k RMSNorm then RoPE, as diffusers' attention processor; `rope` [S, D/2, 2] is the real
    view of the complex rotations."""
    return rope_reference(rms_norm_reference(x, weight, eps), torch.view_as_complex(rope))


def layer_norm_scale_reference(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen-Image 2.1's `_modulate`: `LN(x) * (1 + scale)` in the activation dtype; `scale` already holds each
    token's row ([B, L, D] or [B, 1, D]), as diffusers selects it."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale)


def tanh_gated_residual_reference(
    residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """2.1's residual `residual + gate.tanh() * x` in the activation dtype (`gate` rows already selected)."""
    return residual + gate.tanh() * x


def swiglu_reference(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """2.1's `QwenImage21SwiGLUFeedForward` product `silu(gate_layer(x)) * proj(x)`, activation dtype."""
    return F.silu(g) * p


def zero_centered_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen-Image 2.1's text-input RMSNorm: weight stored as `scale - 1`, applied as `weight + 1`, in fp32."""
    xf = x.float()
    rrms = torch.rsqrt(torch.mean(xf**2, dim=-1, keepdim=True) + eps)
    return (xf * rrms * (weight.float() + 1)).to(x.dtype)
