"""ModelOpt FP8 linears and the quantized activations that fused producers hand them (DESIGN §3).

Producers and consumers meet through two things only: the `quant_key` a consumer accepts and its
`needs_unquantized_input` capability flag, both read through `quant_consumer_spec`.
"""

from dataclasses import dataclass

import torch
from torch import nn

from kernels.quant import FP8_DTYPE, inverse_scale, static_quant_fp8

FP8_STATIC_KEY = "fp8_e4m3fn/per-tensor/static"


@dataclass(frozen=True)
class QuantizedActivation:
    """An activation already quantized for a consumer: FP8 data, its dequant scale, and optionally `y`."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    quant_key: str
    unquantized: torch.Tensor | None = None


@dataclass(frozen=True)
class QuantSpec:
    """What a consumer accepts: the quantization key, its input scale, and whether it also needs `y`."""

    quant_key: str
    input_scale: torch.Tensor
    needs_unquantized_input: bool


def scaled_mm(
    q: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`(q @ W.T) * input_scale * weight_scale + bias` with fp32 accumulation, for q [M, K], W [N, K].

    CUDA runs `torch._scaled_mm`; elsewhere an emulation with the same arithmetic model
    (exact FP8 products, fp32 sums, one rounding to `out_dtype`).
    """
    a_scale = input_scale.float().reshape(())
    b_scale = weight_scale.float().reshape(())
    if q.is_cuda:
        return torch._scaled_mm(
            q, weight.t(), scale_a=a_scale, scale_b=b_scale, bias=bias, out_dtype=out_dtype
        )
    acc = (q.float() @ weight.float().t()) * (a_scale * b_scale)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


class Fp8Linear(nn.Module):
    """A ModelOpt FP8 linear: e4m3 `weight` [out, in], scalar `weight_scale` and `input_scale`, BF16 bias."""

    quant_key = FP8_STATIC_KEY
    reads_row_slices = True  # the quantizer reads each sample's rows in place (no `.contiguous()` first)

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        self.input_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.register_buffer("inv_input_scale", torch.ones(1), persistent=False)
        self.needs_unquantized_input = False

    def post_load_weights(self) -> None:
        """Compute the inverse input scale once, with IEEE division, on the weights' device."""
        self.inv_input_scale = inverse_scale(self.input_scale)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            if x.quant_key != self.quant_key:
                raise RuntimeError(
                    f"activation quantized as {x.quant_key}, consumer expects {self.quant_key}"
                )
            q, scale = x.data, x.scale
        else:
            q, scale = static_quant_fp8(x, self.inv_input_scale), self.input_scale
        out = scaled_mm(
            q.reshape(-1, self.in_features), self.weight, scale, self.weight_scale, self.bias, x.dtype
        )
        lead = q.shape[:-1]
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3fn"


def quant_consumer_spec(module: nn.Module) -> QuantSpec | None:
    """The quantized input `module` accepts, or None when it only takes a plain tensor."""
    if not isinstance(module, Fp8Linear):
        return None
    return QuantSpec(module.quant_key, module.input_scale, module.needs_unquantized_input)
