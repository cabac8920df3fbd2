"""ModelOpt NVFP4 linears (DESIGN §19): 4-bit E2M1 weights with an E4M3 scale per 16 inputs and an fp32
global scale, the quantizer `qwen-image quantize --format nvfp4` writes them with, and their two paths: the
weight path (BF16 activations, the weights dequantized block by block inside the GEMM: kernels/nvfp4.py),
on any GPU and the CPU; and W4A4 for Blackwell's FP4 tensor cores (NVFP4 activations from the producers or
the layer's own quantizer, `torch._scaled_mm` on CUDA capability 10 or later; elsewhere only the CPU, which
runs its exact emulation), chosen per variant by `set_nvfp4_activations`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from qwen_image_fusion.kernels.fp32 import div_rn
from qwen_image_fusion.kernels.nvfp4 import (
    NVFP4_BLOCK,
    dequantize_nvfp4,
    e2m1_decode,
    global_encode_scale,
    nvfp4_linear,
    quantize_nvfp4,
    unpack_e2m1,
)
from qwen_image_fusion.kernels.nvfp4_quant import nvfp4_quant, swizzle_block_scales, unswizzle_block_scales
from qwen_image_fusion.kernels.quant import FP8_DTYPE, inverse_scale
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.fp8 import QuantizedActivation, QuantSpec

NVFP4_KEY = "nvfp4_e2m1/block16-e4m3/static-global"
W4A4_CAPABILITY = (10, 0)  # Blackwell: the first FP4 tensor cores
DOT_UNIT = 2.0**-20  # the exact dot's unit: a product of two operands' units, 0.5 (E2M1) x 2^-9 (E4M3) each


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


def w4a4_target_refusal(device: torch.device) -> str:
    """Empty where NVFP4 W4A4 runs (CUDA capability 10.0 or later; the CPU, through the exact emulation of
    `nvfp4_scaled_mm`), else why not, in one line."""
    if device.type == "cpu":
        return ""
    if device.type != "cuda":
        return f"device {device.type} has no NVFP4 W4A4 GEMM"
    capability = torch.cuda.get_device_capability(device)
    if capability >= W4A4_CAPABILITY:
        return ""
    return (
        f"CUDA capability {capability[0]}.{capability[1]} has no FP4 tensor cores: NVFP4 W4A4 needs "
        f"{W4A4_CAPABILITY[0]}.{W4A4_CAPABILITY[1]} or later (Blackwell)"
    )


def _integer_operand(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """int64 `(2 * e2m1) * (2^9 * e4m3)` [rows, K]: every NVFP4 value in units of 2^-10, exactly."""
    halves = (e2m1_decode(unpack_e2m1(packed)).float() * 2).to(torch.int64)
    units = (block_scale.float() * 512).to(torch.int64).repeat_interleave(NVFP4_BLOCK, dim=-1)
    return halves * units


def exact_nvfp4_dot(
    packed_a: torch.Tensor, scale_a: torch.Tensor, packed_b: torch.Tensor, scale_b: torch.Tensor
) -> torch.Tensor:
    """fp32 `A @ B.T` of NVFP4 rows A [M, K] and B [N, K] (packed codes, unswizzled block scales) before the
    global scales, each dot product exact and then rounded once. Each value is an integer number of 2^-10
    (|value| < 2^22 of them), so a product is an integer number of 2^-20 below 2^44 and K <= 2^19 of them sum
    exactly in int64, in any order; int64 to fp32 rounds to nearest even, and 2^-20 scales exactly. A row
    with a NaN block scale (NaN activations) gives NaN."""
    whole = _integer_operand(packed_a, scale_a) @ _integer_operand(packed_b, scale_b).t()
    nan = scale_a.float().isnan().any(-1)[:, None] | scale_b.float().isnan().any(-1)[None, :]
    return torch.where(nan, torch.nan, whole.to(torch.float32) * DOT_UNIT)


def nvfp4_scaled_mm(
    packed_a: torch.Tensor,
    swizzled_a: torch.Tensor,
    input_scale: torch.Tensor,
    packed_w: torch.Tensor,
    block_scale_w: torch.Tensor,
    weight_scale_2: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The W4A4 GEMM: `(A @ W.T) * input_scale * weight_scale_2 + bias` for NVFP4 activations A [M, K] (block
    scales swizzled, as the producers write them) and weights W [N, K] (the checkpoint's scales). On CUDA
    `torch._scaled_mm`'s NVFP4 recipe (capability 10 or later: the caller's gate); elsewhere the emulation
    whose bytes the contract defines: the exact dot rounded once to fp32, times `alpha` (fp32 `input_scale *
    weight_scale_2`, made once at load), plus the bias in fp32, one rounding to `out_dtype`."""
    if packed_a.is_cuda:
        recipe = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
        swizzle = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
        return F.scaled_mm(
            packed_a.view(torch.float4_e2m1fn_x2),
            packed_w.view(torch.float4_e2m1fn_x2).t(),
            scale_a=[swizzled_a.flatten(), input_scale.float().reshape(1)],
            scale_recipe_a=recipe,
            scale_b=[swizzle_block_scales(block_scale_w).flatten(), weight_scale_2.float().reshape(1)],
            scale_recipe_b=recipe,
            swizzle_a=swizzle,
            swizzle_b=swizzle,
            bias=bias,
            output_dtype=out_dtype,
        )
    rows, cols = packed_a.shape[0], block_scale_w.shape[1]
    acc = exact_nvfp4_dot(packed_a, unswizzle_block_scales(swizzled_a, rows, cols), packed_w, block_scale_w)
    out = acc * alpha
    return (out if bias is None else out + bias.float()).to(out_dtype)


class Nvfp4Linear(nn.Module):
    """A ModelOpt NVFP4 linear: packed E2M1 `weight` uint8 [out, in/2], E4M3 `weight_scale` [out, in/16],
    fp32 `weight_scale_2` and `input_scale` (scalars), BF16 bias. Its forward is the weight path, or with
    `w4a4` (set by `set_nvfp4_activations`) the W4A4 GEMM on NVFP4 activations: a producer's, or its own
    quantization of a BF16 input under the inverse of `input_scale`."""

    quant_key = NVFP4_KEY

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
        self.register_buffer("encode_scale", torch.ones(1), persistent=False)  # 1 / input_scale
        self.register_buffer("alpha", torch.ones(()), persistent=False)  # input_scale * weight_scale_2
        self.w4a4 = False

    def set_w4a4(self, w4a4: bool) -> None:
        """Run W4A4 (or the weight path); the activations' encode scale (IEEE `1 / input_scale`) and the
        GEMM's `alpha` are computed once, on the weights' device."""
        self.w4a4 = w4a4
        self.encode_scale = inverse_scale(self.input_scale)
        self.alpha = self.input_scale.float() * self.weight_scale_2.float()

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if not self.w4a4:
            y = nvfp4_linear(
                x.reshape(-1, self.in_features),
                self.weight,
                self.weight_scale,
                self.weight_scale_2,
                self.bias,
            )
            return y.view(*x.shape[:-1], self.out_features)
        if isinstance(x, QuantizedActivation):
            if x.quant_key != self.quant_key:
                raise RuntimeError(
                    f"activation quantized as {x.quant_key}, consumer expects {self.quant_key}"
                )
            packed, swizzled, dtype = x.data.reshape(-1, self.in_features // 2), x.block_scale, x.dtype
            lead = x.data.shape[:-1]
        else:
            packed, swizzled = nvfp4_quant(x.reshape(-1, self.in_features), self.encode_scale)
            dtype, lead = x.dtype, x.shape[:-1]
        out = nvfp4_scaled_mm(
            packed, swizzled, self.input_scale, self.weight, self.weight_scale, self.weight_scale_2,
            self.alpha, self.bias, dtype,
        )  # fmt: skip
        return out.view(*lead, self.out_features)

    def quant_spec(self) -> QuantSpec | None:
        """What a producer may write for this layer: NVFP4 under its input scale, on the W4A4 path only."""
        return QuantSpec(self.quant_key, self.input_scale, False) if self.w4a4 else None

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 `e2m1 * block scale * weight_scale_2` [out, in]."""
        return dequantize_nvfp4(self.weight, self.weight_scale).float() * self.weight_scale_2.float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4"


def check_w4a4(device: torch.device) -> None:
    """InputError in one line where `device` cannot run NVFP4 W4A4."""
    reason = w4a4_target_refusal(device)
    if reason:
        raise InputError(f"{reason}; the nvfp4 variant (the weight path) runs here")


def set_nvfp4_activations(model: nn.Module, w4a4: bool, device: torch.device) -> None:
    """Put every NVFP4 linear of `model` on the W4A4 path or the weight path (`check_w4a4` first)."""
    if w4a4:
        check_w4a4(device)
    for module in model.modules():
        if isinstance(module, Nvfp4Linear):
            module.set_w4a4(w4a4)
