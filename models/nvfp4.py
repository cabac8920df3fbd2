"""ModelOpt NVFP4 linears (DESIGN §19): 4-bit E2M1 weights with an E4M3 scale per 16 inputs and an fp32
global scale, run by the weight path (BF16 activations, the weights dequantized block by block inside the
GEMM: kernels/nvfp4.py), and the quantizer `qwen-image quantize --format nvfp4` writes them with.
"""

import torch
from torch import nn

from qwen_image_fusion.kernels.fp32 import div_rn
from qwen_image_fusion.kernels.nvfp4 import (
    NVFP4_BLOCK,
    dequantize_nvfp4,
    global_encode_scale,
    nvfp4_linear,
    quantize_nvfp4,
)
from qwen_image_fusion.kernels.quant import FP8_DTYPE


def quantize_nvfp4_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight [N, K] as ModelOpt stores it: packed codes, block scales and `weight_scale_2` (fp32 [], the
    inverse of the global encode scale of the weight's amax: `amax / 2688` up to rounding, and > 0 even for
    an all-zero weight)."""
    g = global_encode_scale(weight.detach().float().abs().amax())
    packed, block_scale = quantize_nvfp4(weight.detach(), g)
    return packed, block_scale, div_rn(torch.ones_like(g), g)


def input_scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The `input_scale` (fp32 []) of a calibrated input amax: the inverse of its global encode scale."""
    g = global_encode_scale(amax.float().reshape(()))
    return div_rn(torch.ones_like(g), g)


class Nvfp4Linear(nn.Module):
    """A ModelOpt NVFP4 linear: packed E2M1 `weight` uint8 [out, in/2], E4M3 `weight_scale` [out, in/16],
    fp32 `weight_scale_2` and `input_scale` (scalars), BF16 bias; its forward is the weight path."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features // 2, dtype=torch.uint8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, in_features // NVFP4_BLOCK, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale_2 = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        self.input_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nvfp4_linear(
            x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.weight_scale_2, self.bias
        )
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 `e2m1 * block scale * weight_scale_2` [out, in]."""
        return dequantize_nvfp4(self.weight, self.weight_scale).float() * self.weight_scale_2.float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4"
