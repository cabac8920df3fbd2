"""The narrow seam between the transformer blocks and the norm/modulate/residual/GELU backends.

Blocks call only these functions (attention calls `norm_rope` for q and k). The numerics mode picks
diffusers' op-for-op arithmetic (`reference`) or the DESIGN §4 rounding contract (`contract`: Triton on
CUDA, torch twin elsewhere); the `*_quant` functions are the contract producers that also write static
FP8 for their consumers. The contract is defined for BF16 activations; other dtypes run the reference
arithmetic. Modulation rows (`shift`, `scale`, `gate`) are per sample [B, D], or [R, D] with `mod_index`
[B, L] int32 naming each token's row (per-token modulation, Edit-2511's `zero_cond_t`).
"""

import torch
import torch.nn.functional as F

from qwen_image_fusion.kernels.gelu_quant import gelu_tanh, gelu_tanh_quant
from qwen_image_fusion.kernels.norm_modulate import (
    gated_residual,
    gated_residual_layer_norm_modulate,
    layer_norm_modulate,
)
from qwen_image_fusion.kernels.numerics import Numerics
from qwen_image_fusion.kernels.nvfp4_producers import (
    gated_residual_layer_norm_modulate_nvfp4,
    layer_norm_modulate_nvfp4,
)
from qwen_image_fusion.kernels.qk_norm_rope import rms_norm_rope
from qwen_image_fusion.kernels.reference import (
    gated_residual_reference,
    layer_norm_modulate_reference,
    layer_norm_scale_reference,
    rms_norm_rope_reference,
    swiglu_reference,
    tanh_gated_residual_reference,
)
from qwen_image_fusion.kernels.scale_modulate import (
    ModulationRows,
    TanhGate,
    layer_norm_scale,
    tanh_gated_residual,
    tanh_residual_layer_norm_scale,
)
from qwen_image_fusion.kernels.swiglu_quant import silu_mul, silu_mul_quant


def _contract(numerics: Numerics, x: torch.Tensor) -> bool:
    return numerics is Numerics.CONTRACT and x.dtype == torch.bfloat16


def norm_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    numerics: Numerics,
    mod_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """`modulate(LN(x), shift, scale)`."""
    if not _contract(numerics, x):
        return layer_norm_modulate_reference(x, shift, scale, eps, mod_index)
    return layer_norm_modulate(x, shift, scale, eps, mod_index=mod_index)[0]


def residual_norm_modulate(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    numerics: Numerics,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`r = residual + gate * x; y = modulate(LN(r))`; returns `(r, y)`."""
    if not _contract(numerics, x):
        r = gated_residual_reference(residual, gate, x, mod_index)
        return r, layer_norm_modulate_reference(r, shift, scale, eps, mod_index)
    r, y, _ = gated_residual_layer_norm_modulate(residual, gate, x, shift, scale, eps, mod_index=mod_index)
    return r, y


def residual_add(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    numerics: Numerics,
    mod_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """`residual + gate * x`."""
    if not _contract(numerics, x):
        return gated_residual_reference(residual, gate, x, mod_index)
    return gated_residual(residual, gate, x, mod_index)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    rope: torch.Tensor,
    eps: float,
    numerics: Numerics,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head RMSNorm of q or k [B, S, H, D], then interleaved-pair RoPE; `rope` [S, D/2, 2] fp32 is the
    real view (cos, sin) of the complex rotations. Writes into `out` (e.g. the text or image rows of the
    joint [text, image] buffer) when given and returns it. Contract: one Triton launch on CUDA."""
    if not (_contract(numerics, x) and weight.dtype == torch.bfloat16):
        y = rms_norm_rope_reference(x, weight, rope, eps)
        return y if out is None else out.copy_(y)
    return rms_norm_rope(x, weight, rope, eps, out)


def gelu(x: torch.Tensor, numerics: Numerics) -> torch.Tensor:
    """GELU with the tanh approximation."""
    if not _contract(numerics, x):
        return F.gelu(x, approximate="tanh")
    return gelu_tanh(x)


def norm_modulate_quant(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor,
    write_y: bool,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Fused producer 1: `(y or None, q)`."""
    return layer_norm_modulate(x, shift, scale, eps, inv_scale, write_y, mod_index)


def residual_norm_modulate_quant(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor,
    write_y: bool,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Fused producer 2: `(r, y or None, q)`."""
    return gated_residual_layer_norm_modulate(
        residual, gate, x, shift, scale, eps, inv_scale, write_y, mod_index
    )


def norm_modulate_nvfp4(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    encode_scale: torch.Tensor | None,
    write_y: bool,
    write_q: bool,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Producer 1 for NVFP4 W4A4 consumers: `(y or None, packed codes [B, L, D/2] or None, swizzled block
    scales or None)`; one binary whether it writes q (fused) or only y (unfused: the consumer quantizes)."""
    y, q, s = layer_norm_modulate_nvfp4(x, shift, scale, eps, encode_scale, write_y, write_q, mod_index)
    return y, None if q is None else q.view(*x.shape[:-1], -1), s


def residual_norm_modulate_nvfp4(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    encode_scale: torch.Tensor | None,
    write_y: bool,
    write_q: bool,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Producer 2 for NVFP4 W4A4 consumers: `(r, y or None, packed codes or None, block scales or None)`."""
    r, y, q, s = gated_residual_layer_norm_modulate_nvfp4(
        residual, gate, x, shift, scale, eps, encode_scale, write_y, write_q, mod_index
    )
    return r, y, None if q is None else q.view(*x.shape[:-1], -1), s


def gelu_quant(
    x: torch.Tensor, inv_scale: torch.Tensor, write_g: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Fused GELU(tanh) + static FP8 quant for the MLP down-projection: `(g or None, q)`."""
    return gelu_tanh_quant(x, inv_scale, write_g)


# Qwen-Image 2.1 (DESIGN §4.1): scale-only modulation with per-token rows, tanh gates, SwiGLU.


def norm_scale(
    x: torch.Tensor, scale: torch.Tensor, rows: ModulationRows, eps: float, numerics: Numerics
) -> torch.Tensor:
    """`LN(x) * (1 + scale[row])`, each token reading its modulation row of `scale` [R, D]."""
    if not _contract(numerics, x):
        return layer_norm_scale_reference(x, rows.select(scale), eps)
    return layer_norm_scale(x, scale, rows.index, eps)[0]


def norm_scale_quant(
    x: torch.Tensor,
    scale: torch.Tensor,
    rows: ModulationRows,
    eps: float,
    inv_scale: torch.Tensor,
    write_y: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Fused producer (a): `(y or None, q)`."""
    return layer_norm_scale(x, scale, rows.index, eps, inv_scale, write_y)


def tanh_residual_norm_scale(
    residual: torch.Tensor,
    gate: TanhGate,
    x: torch.Tensor,
    scale: torch.Tensor,
    rows: ModulationRows,
    eps: float,
    numerics: Numerics,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`r = residual + tanh(gate[row]) * x; y = LN(r) * (1 + scale[row])`; returns `(r, y)`."""
    if not _contract(numerics, x):
        r = tanh_gated_residual_reference(residual, rows.select(gate.rows), x)
        return r, layer_norm_scale_reference(r, rows.select(scale), eps)
    r, y, _ = tanh_residual_layer_norm_scale(residual, gate.tanh, x, scale, rows.index, eps)
    return r, y


def tanh_residual_norm_scale_quant(
    residual: torch.Tensor,
    gate: TanhGate,
    x: torch.Tensor,
    scale: torch.Tensor,
    rows: ModulationRows,
    eps: float,
    inv_scale: torch.Tensor,
    write_y: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Fused producer (b): `(r, y or None, q)`."""
    return tanh_residual_layer_norm_scale(residual, gate.tanh, x, scale, rows.index, eps, inv_scale, write_y)


def tanh_residual(
    residual: torch.Tensor, gate: TanhGate, x: torch.Tensor, rows: ModulationRows, numerics: Numerics
) -> torch.Tensor:
    """`residual + tanh(gate[row]) * x` (after the MLP)."""
    if not _contract(numerics, x):
        return tanh_gated_residual_reference(residual, rows.select(gate.rows), x)
    return tanh_gated_residual(residual, gate.tanh, x, rows.index)


def swiglu(g: torch.Tensor, p: torch.Tensor, numerics: Numerics) -> torch.Tensor:
    """`silu(g) * p` of the MLP's gate_layer and proj outputs."""
    if not _contract(numerics, g):
        return swiglu_reference(g, p)
    return silu_mul(g, p)


def swiglu_quant(
    g: torch.Tensor, p: torch.Tensor, inv_scale: torch.Tensor, write_y: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Fused producer (c), SwiGLU + static FP8 quant for the MLP's `out`: `(y or None, q)`."""
    return silu_mul_quant(g, p, inv_scale, write_y)
