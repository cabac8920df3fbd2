"""Fused FP8 producer kernels (Triton) with their torch reference twins; see DESIGN §4.

Each op comes as `<op>_torch` (the reference), `<op>_triton` (None when its guard rejects the input)
and `<op>` (Triton on CUDA when accepted, else the torch twin; CPU always takes the twin). Names load
lazily, so `kernels.numerics` stays importable without torch.
"""

import importlib
from typing import Any

_LAZY = {
    "FP8_DTYPE": "kernels.quant",
    "FP8_MAX": "kernels.quant",
    "ModulationRows": "kernels.scale_modulate",
    "TanhGate": "kernels.scale_modulate",
    "gated_residual": "kernels.norm_modulate",
    "gated_residual_layer_norm_modulate": "kernels.norm_modulate",
    "gated_residual_layer_norm_modulate_torch": "kernels.norm_modulate",
    "gated_residual_layer_norm_modulate_triton": "kernels.norm_modulate",
    "gated_residual_torch": "kernels.norm_modulate",
    "gated_residual_triton": "kernels.norm_modulate",
    "gelu_tanh": "kernels.gelu_quant",
    "gelu_tanh_quant": "kernels.gelu_quant",
    "gelu_tanh_quant_torch": "kernels.gelu_quant",
    "gelu_tanh_quant_triton": "kernels.gelu_quant",
    "gelu_tanh_torch": "kernels.gelu_quant",
    "gelu_tanh_triton": "kernels.gelu_quant",
    "inverse_scale": "kernels.quant",
    "layer_norm_modulate": "kernels.norm_modulate",
    "layer_norm_modulate_torch": "kernels.norm_modulate",
    "layer_norm_modulate_triton": "kernels.norm_modulate",
    "layer_norm_scale": "kernels.scale_modulate",
    "layer_norm_scale_torch": "kernels.scale_modulate",
    "layer_norm_scale_triton": "kernels.scale_modulate",
    "layer_norm_torch": "kernels.norm_modulate",
    "modulate_torch": "kernels.norm_modulate",
    "rms_norm_rope": "kernels.qk_norm_rope",
    "rms_norm_rope_torch": "kernels.qk_norm_rope",
    "rms_norm_rope_triton": "kernels.qk_norm_rope",
    "silu_mul": "kernels.swiglu_quant",
    "silu_mul_quant": "kernels.swiglu_quant",
    "silu_mul_quant_torch": "kernels.swiglu_quant",
    "silu_mul_quant_triton": "kernels.swiglu_quant",
    "silu_mul_torch": "kernels.swiglu_quant",
    "silu_mul_triton": "kernels.swiglu_quant",
    "static_quant_fp8": "kernels.quant",
    "static_quant_fp8_torch": "kernels.quant",
    "static_quant_fp8_triton": "kernels.quant",
    "tanh_gated_residual": "kernels.scale_modulate",
    "tanh_gated_residual_torch": "kernels.scale_modulate",
    "tanh_gated_residual_triton": "kernels.scale_modulate",
    "tanh_residual_layer_norm_scale": "kernels.scale_modulate",
    "tanh_residual_layer_norm_scale_torch": "kernels.scale_modulate",
    "tanh_residual_layer_norm_scale_triton": "kernels.scale_modulate",
    "tanh_rows": "kernels.scale_modulate",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
