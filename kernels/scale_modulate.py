"""Qwen-Image 2.1's norm producers: LayerNorm + scale-only modulation, and the tanh-gated residual before
it, with per-token modulation rows; torch twins and Triton side by side (DESIGN §4.1).

Contract (bf16 activations, fp32 math, one bf16 rounding per written tensor, no FMA contraction):
  n = bf16(x_hat), the LayerNorm of DESIGN §4 (rstd = 1/sqrt(var + eps), IEEE sqrt and division);
  y = bf16(fp32(n) * (1 + fp32(scale[row])));                        producer (a), feeds Q/K/V
  t = fp32(tanh(fp32(gate))), the fp32 rounding of a float64 tanh, once per forward over the [R, D]
      modulation rows (`tanh_rows`, the same torch function for the twin and the kernel's input);
  r = bf16(fp32(residual) + t[row] * fp32(x));  y = the scale-only LN of r;   producer (b), feeds the MLP
  q = the static quantizer of DESIGN §4 applied to bf16 y.
`row` is the modulation row each token reads: `index` [B, L] int32 into the rows of the shared projection
(2.1 with `causal_condition`: the sample's own row for target tokens, the t = 0 row for the prefix). The
index is data: one kernel serves per-sample and per-token modulation; its values are not checked (that
would need a host sync), the caller builds them.
Only the order of the LN sums may differ between the Triton kernels and the twins; `r` and `t` are equal.
Each Triton producer is one compiled binary whose outputs are picked by runtime int flags, so the unfused
path (write y, then quantize it) and the fused one (write q) run the same reduction and agree bit for bit.
"""

from typing import NamedTuple

import torch

from qwen_image_fusion.kernels._triton_common import (
    FusedOp,
    dummy,
    jit,
    row_launch,
    row_outputs,
    row_producer_ok,
    tl,
)
from qwen_image_fusion.kernels.norm_modulate import layer_norm_torch
from qwen_image_fusion.kernels.quant import quant_fp8, static_quant_fp8_torch


class ModulationRows(NamedTuple):
    """Which modulation row each token reads: `index` [B, L] int32; `per_token` False when every token reads
    its sample's row (diffusers then broadcasts `params.unsqueeze(1)`), True when rows differ per token."""

    index: torch.Tensor
    per_token: bool

    def select(self, params: torch.Tensor) -> torch.Tensor:
        """The rows as diffusers' `_select_modulation_rows` shapes them: [B, L, D] or [B, 1, D]."""
        return params[self.index] if self.per_token else params.unsqueeze(1)


class TanhGate(NamedTuple):
    """A gate's modulation rows [R, D] (activation dtype) and their fp32 tanh, computed once per forward."""

    rows: torch.Tensor
    tanh: torch.Tensor

    @classmethod
    def of(cls, gate: torch.Tensor) -> "TanhGate":
        return cls(gate, tanh_rows(gate))


def tanh_rows(gate: torch.Tensor) -> torch.Tensor:
    """`t = fp32(tanh(fp32(gate)))` rounded once from float64: the same bits in every layout and thread count
    (torch's fp32 transcendentals are not), and on every device for bf16 gates (tests/gpu checks CUDA)."""
    return torch.tanh(gate.double()).float()


def scale_modulate_torch(normed: torch.Tensor, scale: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`bf16(fp32(n) * (1 + fp32(scale[row])))` for each token's row."""
    return (normed.float() * (1.0 + scale.float()[index])).to(normed.dtype)


def tanh_gated_residual_torch(
    residual: torch.Tensor, tanh_gate: torch.Tensor, x: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """`r = bf16(fp32(residual) + t[row] * fp32(x))`, no FMA, one rounding."""
    return (residual.float() + tanh_gate.float()[index] * x.float()).to(residual.dtype)


def layer_norm_scale_torch(
    x: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Producer (a): `y = LN(x) * (1 + scale[row])`; with `inv_scale` also its FP8 `q`. Returns `(y, q)`:
    `y` None when `write_y` is False, `q` None without `inv_scale`."""
    y = scale_modulate_torch(layer_norm_torch(x, eps), scale, index)
    q = None if inv_scale is None else static_quant_fp8_torch(y, inv_scale)
    return (y if write_y else None), q


def tanh_residual_layer_norm_scale_torch(
    residual: torch.Tensor,
    tanh_gate: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Producer (b): `r = residual + t[row] * x; y = LN(r) * (1 + scale[row])`; returns `(r, y, q)`."""
    r = tanh_gated_residual_torch(residual, tanh_gate, x, index)
    y, q = layer_norm_scale_torch(r, scale, index, eps, inv_scale, write_y)
    return r, y, q


@jit()
def _layer_norm_scale_row(v, mask, cols, width, eps, scale, y_ptr, q_ptr, inv_ptr, write_y, write_q):
    """LN + scale-only modulate of one fp32 row `v` (zero past `width`); stores y and/or q at the row."""
    width_f = width.to(tl.float32)
    mean = tl.math.div_rn(tl.sum(v, axis=0), width_f)
    centered = tl.where(mask, v - mean, 0.0)
    var = tl.math.div_rn(tl.sum(centered * centered, axis=0), width_f)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    normed = (centered * rstd).to(tl.bfloat16)
    y = (normed.to(tl.float32) * (1.0 + scale)).to(tl.bfloat16)
    if write_y != 0:
        tl.store(y_ptr + cols, y, mask=mask)
    if write_q != 0:
        tl.store(q_ptr + cols, quant_fp8(y, inv_ptr), mask=mask)


@jit(do_not_specialize=["write_y", "write_q"])
def _layer_norm_scale_kernel(
    x_ptr, scale_ptr, index_ptr, y_ptr, q_ptr, inv_ptr,
    width, scale_stride, eps, write_y, write_q,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    mod_row = tl.load(index_ptr + row).to(tl.int64)
    scale = tl.load(scale_ptr + mod_row * scale_stride + cols, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    _layer_norm_scale_row(
        v, mask, cols, width, eps, scale, y_ptr + row * width, q_ptr + row * width, inv_ptr, write_y, write_q
    )


@jit(do_not_specialize=["write_y", "write_q"])
def _tanh_residual_layer_norm_scale_kernel(
    res_ptr, tanh_ptr, x_ptr, scale_ptr, index_ptr, r_ptr, y_ptr, q_ptr, inv_ptr,
    width, tanh_stride, scale_stride, eps, write_y, write_q,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    offs = row * width + cols
    mod_row = tl.load(index_ptr + row).to(tl.int64)
    res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(tanh_ptr + mod_row * tanh_stride + cols, mask=mask, other=0.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = (res + t * x).to(tl.bfloat16)
    tl.store(r_ptr + offs, r, mask=mask)
    if (write_y | write_q) != 0:
        scale = tl.load(scale_ptr + mod_row * scale_stride + cols, mask=mask, other=0.0).to(tl.float32)
        _layer_norm_scale_row(
            r.to(tl.float32), mask, cols, width, eps, scale, y_ptr + row * width, q_ptr + row * width,
            inv_ptr, write_y, write_q,
        )  # fmt: skip


def _layer_norm_scale_ok(
    x: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
) -> bool:
    return row_producer_ok(_layer_norm_scale_kernel, [x], [(scale, torch.bfloat16)], index, inv_scale)


def _launch_layer_norm_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Producer (a)'s binary on guarded inputs (same returns as the twin)."""
    write_q = inv_scale is not None
    if not (write_y or write_q):
        return None, None
    y, q, inv = row_outputs(x, inv_scale, write_y)
    grid, options = row_launch(x)
    _layer_norm_scale_kernel[grid](
        x, scale, index, y, q, inv, x.shape[2], scale.stride(0), eps, int(write_y), int(write_q), **options
    )
    return (y if write_y else None), (q if write_q else None)


def _tanh_residual_ok(
    residual: torch.Tensor,
    tanh_gate: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
) -> bool:
    kernel = _tanh_residual_layer_norm_scale_kernel
    rows = [(scale, torch.bfloat16), (tanh_gate, torch.float32)]
    return row_producer_ok(kernel, [residual, x], rows, index, inv_scale)


def _launch_tanh_residual(
    residual: torch.Tensor,
    tanh_gate: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Producer (b)'s binary on guarded inputs (same returns as the twin)."""
    r = torch.empty_like(residual)
    y, q, inv = row_outputs(residual, inv_scale, write_y)
    grid, options = row_launch(residual)
    _tanh_residual_layer_norm_scale_kernel[grid](
        residual, tanh_gate, x, scale, index, r, y, q, inv, residual.shape[2], tanh_gate.stride(0),
        scale.stride(0), eps, int(write_y), int(inv_scale is not None), **options,
    )  # fmt: skip
    return r, (y if write_y else None), (q if inv_scale is not None else None)


def _tanh_gated_residual_ok(
    residual: torch.Tensor, tanh_gate: torch.Tensor, x: torch.Tensor, index: torch.Tensor
) -> bool:
    kernel = _tanh_residual_layer_norm_scale_kernel
    return row_producer_ok(kernel, [residual, x], [(tanh_gate, torch.float32)], index, None)


def _launch_tanh_gated_residual(
    residual: torch.Tensor, tanh_gate: torch.Tensor, x: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """Producer (b)'s binary with y and q off (no LN runs; the scale pointer is a bf16 dummy, so the binary
    is the same as the producer's)."""
    rows = dummy(residual.device, torch.bfloat16).view(1, -1)
    return _launch_tanh_residual(residual, tanh_gate, x, rows, index, 0.0, None, False)[0]


# Producer (a), producer (b), and the tanh-gated residual alone (after the MLP): Triton on CUDA when the
# guard accepts, else the torch twin (always on CPU).
layer_norm_scale = FusedOp(layer_norm_scale_torch, _launch_layer_norm_scale, _layer_norm_scale_ok)
tanh_residual_layer_norm_scale = FusedOp(
    tanh_residual_layer_norm_scale_torch, _launch_tanh_residual, _tanh_residual_ok
)
tanh_gated_residual = FusedOp(tanh_gated_residual_torch, _launch_tanh_gated_residual, _tanh_gated_residual_ok)
layer_norm_scale_triton = layer_norm_scale.triton
tanh_residual_layer_norm_scale_triton = tanh_residual_layer_norm_scale.triton
tanh_gated_residual_triton = tanh_gated_residual.triton
