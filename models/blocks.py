"""Building blocks every family's transformer shares: the producer base the FP8 fusion gate configures, the
q/k RMSNorm + RoPE module, and the gate run over a transformer's blocks after loading."""

import torch
from torch import nn

from qwen_image_fusion.kernels.numerics import Numerics
from qwen_image_fusion.kernels.seam import norm_rope
from qwen_image_fusion.models.fp8 import FP8_STATIC_KEY, Fp8Linear, QuantizedActivation
from qwen_image_fusion.models.fusion import FusionReport, ProducerQuant, fusion_enabled_by_env
from qwen_image_fusion.models.numerics import NumericsAware, set_numerics
from qwen_image_fusion.models.nvfp4 import Nvfp4Linear

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
    quant_keys: tuple[str, ...] = (FP8_STATIC_KEY,)  # the formats its fused kernels write

    def __init__(self, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.quant: ProducerQuant | None = None

    def quantized(
        self,
        y: torch.Tensor | None,
        q: torch.Tensor,
        dtype: torch.dtype,
        block_scale: torch.Tensor | None = None,
    ) -> QuantizedActivation:
        return QuantizedActivation(q, self.quant.input_scale, dtype, self.quant.quant_key, y, block_scale)


def gate_blocks(model: nn.Module, fuse: bool | None, mlp_label: str = "GELU") -> FusionReport:
    """A transformer's `post_load_weights`: FP8 inverse scales, contract numerics for FP8 weights, then every
    block's fusion gate (`block.post_load_weights`), as one report. `fuse=False` (or
    QWEN_IMAGE_FP8_FUSION=0) forces the unfused path. Block paths named `*_hidden` are MLP paths."""
    fuse = fusion_enabled_by_env() if fuse is None else fuse and fusion_enabled_by_env()
    fp8 = [module for module in model.modules() if isinstance(module, Fp8Linear)]
    for module in fp8:
        module.post_load_weights()
    if fp8:
        set_numerics(model, Numerics.CONTRACT)
    decisions = [
        d
        for i, block in enumerate(model.transformer_blocks)
        for d in block.post_load_weights(fuse, prefix=f"transformer_blocks.{i}.")
    ]
    nvfp4 = any(isinstance(module, Nvfp4Linear) and module.w4a4 for module in model.modules())
    return FusionReport(
        block=tuple(d for d in decisions if not d.name.endswith("_hidden")),
        mlp=tuple(d for d in decisions if d.name.endswith("_hidden")),
        mlp_label=mlp_label,
        quant_label="NVFP4" if nvfp4 else "FP8",
    )
