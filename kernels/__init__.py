"""Fused FP8 producer kernels (Triton) with their torch reference twins; see DESIGN §4.

Each op comes as `<op>_torch` (the reference), `<op>_triton` (None when its guard rejects the input)
and `<op>` (Triton on CUDA when accepted, else the torch twin; CPU always takes the twin).
"""

from kernels.gelu_quant import (
    gelu_tanh,
    gelu_tanh_quant,
    gelu_tanh_quant_torch,
    gelu_tanh_quant_triton,
    gelu_tanh_torch,
    gelu_tanh_triton,
)
from kernels.norm_modulate import (
    gated_residual,
    gated_residual_layer_norm_modulate,
    gated_residual_layer_norm_modulate_torch,
    gated_residual_layer_norm_modulate_triton,
    gated_residual_torch,
    gated_residual_triton,
    layer_norm_modulate,
    layer_norm_modulate_torch,
    layer_norm_modulate_triton,
    layer_norm_torch,
    modulate_torch,
)
from kernels.qk_norm_rope import rms_norm_rope, rms_norm_rope_torch, rms_norm_rope_triton
from kernels.quant import (
    FP8_DTYPE,
    FP8_MAX,
    inverse_scale,
    static_quant_fp8,
    static_quant_fp8_torch,
    static_quant_fp8_triton,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "gated_residual",
    "gated_residual_layer_norm_modulate",
    "gated_residual_layer_norm_modulate_torch",
    "gated_residual_layer_norm_modulate_triton",
    "gated_residual_torch",
    "gated_residual_triton",
    "gelu_tanh",
    "gelu_tanh_quant",
    "gelu_tanh_quant_torch",
    "gelu_tanh_quant_triton",
    "gelu_tanh_torch",
    "gelu_tanh_triton",
    "inverse_scale",
    "layer_norm_modulate",
    "layer_norm_modulate_torch",
    "layer_norm_modulate_triton",
    "layer_norm_torch",
    "modulate_torch",
    "rms_norm_rope",
    "rms_norm_rope_torch",
    "rms_norm_rope_triton",
    "static_quant_fp8",
    "static_quant_fp8_torch",
    "static_quant_fp8_triton",
]
