"""FP8 weight-only linears: E4M3 weights with one fp32 scale per output channel, BF16 input and output.

For layers whose input is a handful of rows (Qwen-Image's modulation linears `img_mod.1` / `txt_mod.1`:
one conditioning row per sample, 13.6 GB of the full-size transformer in BF16), quantizing the input buys
nothing, but storing the weight in FP8 halves both the bytes the layer occupies (and that a memory plan
streams) and the bytes its GEMV reads (kernels/fp8_gemv.py). Per-channel scales keep each output
channel's range. A checkpoint marks these layers in its quantization config (`weight_only_per_channel`
globs, this project's extension of the ModelOpt format: other ModelOpt consumers do not read them).
"""

import torch
from torch import nn

from qwen_image_fusion.kernels.fp8_gemv import fp8_gemv
from qwen_image_fusion.kernels.quant import FP8_DTYPE, FP8_MAX
from qwen_image_fusion.models.fp8 import MIN_AMAX

WEIGHT_ONLY_KEY = "weight_only_per_channel"  # quantization_config: globs of the weight-only FP8 linears


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 weight and fp32 scales [out] = each row's amax / 448 (an all-zero row still gets one > 0)."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp_min(MIN_AMAX) / FP8_MAX
    return (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8WeightOnlyLinear(nn.Module):
    """`y = (x @ (W * s).T) + b` with `weight` E4M3 [out, in], `weight_scale` fp32 [out] and a BF16 bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_gemv(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized_weight(self, device: torch.device | None = None) -> torch.Tensor:
        """fp32 `weight * scale` per row (exact), computed on `device` (default the weight's)."""
        device = self.weight.device if device is None else device
        return self.weight.to(device).float() * self.weight_scale.to(device).float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3fn weight-only"
