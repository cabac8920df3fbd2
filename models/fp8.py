"""ModelOpt FP8 linears and the quantized activations that fused producers hand them (DESIGN §3).

Producers and consumers meet through one capability only: a consumer's `quant_spec()` (the `quant_key`
it accepts, its input scale, and whether it also needs the BF16 input), read through
`quant_consumer_spec`. Wrappers (a LoRA around an FP8 linear) delegate it and add what they need.
"""

from dataclasses import dataclass

import torch
from torch import nn

from qwen_image_fusion.kernels.quant import FP8_DTYPE, FP8_MAX, exact_fp8_dot, inverse_scale, static_quant_fp8

FP8_STATIC_KEY = "fp8_e4m3fn/per-tensor/static"
MIN_AMAX = 1e-8  # an all-zero weight still gets a positive scale


@dataclass(frozen=True)
class QuantizedActivation:
    """An activation already quantized for a consumer: FP8 data (or NVFP4 packed codes with their swizzled
    `block_scale`: models/nvfp4.py), its dequant scale, and optionally `y`."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    quant_key: str
    unquantized: torch.Tensor | None = None
    block_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class QuantSpec:
    """What a consumer accepts: the quantization key, its input scale, and whether it also needs `y`
    (with the reason, for the fusion report)."""

    quant_key: str
    input_scale: torch.Tensor
    needs_unquantized_input: bool
    unquantized_reason: str = ""


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor E4M3 weight and its fp32 scalar scale `amax / 448` (ModelOpt's weight quantization)."""
    weight = weight.float()
    scale = weight.abs().amax().clamp_min(MIN_AMAX) / FP8_MAX
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(())


def scaled_mm(
    q: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`(q @ W.T) * input_scale * weight_scale + bias` with fp32 accumulation, for q [M, K], W [N, K].

    CUDA runs `torch._scaled_mm`; elsewhere an emulation whose bytes are the same on every machine: the
    dot products summed exactly (in float64, see `exact_fp8_dot`) and rounded once to fp32, then the
    scales and the bias applied in fp32, one rounding to `out_dtype`.
    """
    a_scale = input_scale.float().reshape(())
    b_scale = weight_scale.float().reshape(())
    if q.is_cuda:
        return torch._scaled_mm(
            q, weight.t(), scale_a=a_scale, scale_b=b_scale, bias=bias, out_dtype=out_dtype
        )
    acc = exact_fp8_dot(q, weight) * (a_scale * b_scale)
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

    def quant_spec(self) -> QuantSpec:
        """The capability the fusion gate reads: static FP8 input with this layer's scale."""
        return QuantSpec(self.quant_key, self.input_scale, self.needs_unquantized_input)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 `weight * weight_scale` (exact: an E4M3 value times an fp32 scale fits fp32)."""
        return self.weight.float() * self.weight_scale.float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3fn"


def quant_consumer_spec(module: nn.Module) -> QuantSpec | None:
    """The quantized input `module` accepts (its `quant_spec()` capability), or None for plain tensors."""
    spec = getattr(module, "quant_spec", None)
    return None if spec is None else spec()
