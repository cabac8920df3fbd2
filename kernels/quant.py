"""Static per-tensor FP8 (E4M3) quantizer: torch twin of DESIGN §4.

`q = e4m3fn(clamp(fp32(y) * inv_s, -448, 448))` with `inv_s = fp32(1 / input_scale)` computed once,
with IEEE division, when the scales are loaded. Nothing divides by the scale per call.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def inverse_scale(input_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [1] tensor `1 / input_scale`, by IEEE division, on the scale's device."""
    scale = input_scale.detach().to(torch.float32).reshape(1)
    return torch.ones_like(scale) / scale


def static_quant_fp8_torch(y: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """Quantize `y` to E4M3 with a precomputed inverse scale (round to nearest even, NaN kept)."""
    return (y.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
