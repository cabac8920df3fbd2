"""Building blocks every family's transformer shares: the producer base the FP8 fusion gate configures, and
the q/k RMSNorm + RoPE module."""

import torch
from torch import nn

from kernels.seam import norm_rope
from models.fp8 import QuantizedActivation
from models.fusion import ProducerQuant
from models.numerics import NumericsAware

EPS = 1e-6


class QKNorm(NumericsAware, nn.Module):
    """Per-head RMSNorm of q or k (diffusers' `RMSNorm` weight), then RoPE; writes rows of a joint buffer."""

    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return norm_rope(x, self.weight, rope, self.eps, self.numerics, out)


class Producer(NumericsAware, nn.Module):
    """Base of the modules whose output feeds linears: set by `post_load_weights` to write FP8 or not."""

    writes_y = True  # capability for the gate: the fused kernels can also write BF16 `y`

    def __init__(self, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.quant: ProducerQuant | None = None

    def quantized(self, y: torch.Tensor | None, q: torch.Tensor, dtype: torch.dtype) -> QuantizedActivation:
        return QuantizedActivation(q, self.quant.input_scale, dtype, self.quant.quant_key, y)
