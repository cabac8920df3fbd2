"""LayerNorm + AdaLN modulate producers (and the gated residual before them): torch twins and Triton.

Every function follows the rounding contract of DESIGN §4: fp32 math, one bf16 rounding per written tensor,
no FMA contraction (each torch op rounds on its own; Triton launches with fp fusion off), IEEE sqrt and
division. The torch twins use only machine-independent arithmetic (kernels/fp32.py: LN sums in a pinned
order, correctly rounded sqrt), so they give the same bytes on every CPU. Activations are [B, L, D];
`shift`, `scale` and `gate` are modulation rows [R, D] (rows may be strided, e.g. chunks of the modulation
output). Without `mod_index` the rows are per sample (R = B, token (b, l) takes row b); with `mod_index`, an
int32 [B, L] tensor, token (b, l) takes row `mod_index[b, l]`: per-token modulation, as Edit-2511's
`zero_cond_t` needs (reference-image tokens use the rows of t = 0). Selecting a row is exact, so the
per-token contract is the per-sample one, row by row.

Each Triton producer is ONE compiled binary whose outputs and row selection are picked by runtime int
flags (never specialized), so the unfused path (write y, then quantize it) and the fused one (write q) run
the very same LN reduction and agree bit for bit, per sample or per token. Unused outputs (and the index of
a per-sample launch) get a dummy pointer of the same dtype.
"""

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
from qwen_image_fusion.kernels.fp32 import div_rn, row_sum, sqrt_rn
from qwen_image_fusion.kernels.quant import quant_fp8, static_quant_fp8_torch


def layer_norm_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`bf16(x_hat)`: LayerNorm without affine in fp32, rounded once (sums in `row_sum`'s order)."""
    xf = x.float()
    width = xf.shape[-1]
    mean = div_rn(row_sum(xf), width)
    centered = xf - mean
    var = div_rn(row_sum(centered * centered), width)
    rstd = div_rn(torch.ones_like(var), sqrt_rn(var + eps))
    return (centered * rstd).to(x.dtype)


def token_rows(mod: torch.Tensor, mod_index: torch.Tensor | None) -> torch.Tensor:
    """fp32 modulation rows over the tokens: [B, 1, D] per sample, or [B, L, D] picked by `mod_index`."""
    mod = mod.float()
    return mod.unsqueeze(1) if mod_index is None else mod[mod_index]


def modulate_torch(
    normed: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, mod_index: torch.Tensor | None = None
) -> torch.Tensor:
    """`bf16(fp32(n) * (1 + fp32(scale)) + fp32(shift))`, each fp32 op rounded on its own."""
    one_plus_scale = 1.0 + token_rows(scale, mod_index)
    return (normed.float() * one_plus_scale + token_rows(shift, mod_index)).to(normed.dtype)


def gated_residual_torch(
    residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, mod_index: torch.Tensor | None = None
) -> torch.Tensor:
    """`bf16(fp32(residual) + fp32(gate) * fp32(x))`, no FMA, one rounding."""
    return (residual.float() + token_rows(gate, mod_index) * x.float()).to(residual.dtype)


def layer_norm_modulate_torch(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Producer 1: `y = modulate(LN(x))`; with `inv_scale`, also its FP8 quantization `q`.

    Returns `(y, q)`; `y` is None when `write_y` is False, `q` is None without `inv_scale`.
    """
    y = modulate_torch(layer_norm_torch(x, eps), shift, scale, mod_index)
    q = None if inv_scale is None else static_quant_fp8_torch(y, inv_scale)
    return (y if write_y else None), q


def gated_residual_layer_norm_modulate_torch(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Producer 2: `r = residual + gate * x; y = modulate(LN(r))`; returns `(r, y, q)` like producer 1."""
    r = gated_residual_torch(residual, gate, x, mod_index)
    y, q = layer_norm_modulate_torch(r, shift, scale, eps, inv_scale, write_y, mod_index)
    return r, y, q


@jit()
def modulation_row(row, seq_len, index_ptr, per_token):
    """The modulation row of activation row `row`: its sample, or `mod_index[row]` when `per_token`."""
    mod_row = row // seq_len
    if per_token != 0:
        mod_row = tl.load(index_ptr + row).to(tl.int64)
    return mod_row


@jit()
def load_modulation(shift_ptr, scale_ptr, cols, mask):
    """fp32 shift and scale of one modulation row, loaded before the LN sums so their latency overlaps."""
    shift = tl.load(shift_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return shift, scale


@jit()
def layer_norm_modulate_row(v, mask, width, eps, shift, scale):
    """bf16 `modulate(LN(v))` of one fp32 row `v` (zero past `width`): the contract above."""
    width_f = width.to(tl.float32)
    mean = tl.math.div_rn(tl.sum(v, axis=0), width_f)
    centered = tl.where(mask, v - mean, 0.0)
    var = tl.math.div_rn(tl.sum(centered * centered, axis=0), width_f)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    normed = (centered * rstd).to(tl.bfloat16)
    return (normed.to(tl.float32) * (1.0 + scale) + shift).to(tl.bfloat16)


@jit()
def _layer_norm_modulate_row(
    v, mask, cols, width, eps, shift, scale, y_ptr, q_ptr, inv_ptr, write_y, write_q
):
    """LN + modulate of one fp32 row `v` (zero past `width`); stores y and/or q. Pointers at the row."""
    y = layer_norm_modulate_row(v, mask, width, eps, shift, scale)
    if write_y != 0:
        tl.store(y_ptr + cols, y, mask=mask)
    if write_q != 0:
        tl.store(q_ptr + cols, quant_fp8(y, inv_ptr), mask=mask)


@jit(do_not_specialize=["write_y", "write_q", "per_token"])
def _layer_norm_modulate_kernel(
    x_ptr, shift_ptr, scale_ptr, index_ptr, y_ptr, q_ptr, inv_ptr,
    seq_len, width, shift_stride, scale_stride, eps, write_y, write_q, per_token,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    mod_row = modulation_row(row, seq_len, index_ptr, per_token)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    v = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    shift, scale = load_modulation(
        shift_ptr + mod_row * shift_stride, scale_ptr + mod_row * scale_stride, cols, mask
    )
    _layer_norm_modulate_row(
        v, mask, cols, width, eps, shift, scale, y_ptr + row * width, q_ptr + row * width, inv_ptr,
        write_y, write_q,
    )  # fmt: skip


@jit(do_not_specialize=["write_y", "write_q", "per_token"])
def _gated_residual_layer_norm_modulate_kernel(
    res_ptr, gate_ptr, x_ptr, shift_ptr, scale_ptr, index_ptr, r_ptr, y_ptr, q_ptr, inv_ptr,
    seq_len, width, gate_stride, shift_stride, scale_stride, eps, write_y, write_q, per_token,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    mod_row = modulation_row(row, seq_len, index_ptr, per_token)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    offs = row * width + cols
    res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + mod_row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = (res + gate * x).to(tl.bfloat16)
    tl.store(r_ptr + offs, r, mask=mask)
    if (write_y | write_q) != 0:
        shift, scale = load_modulation(
            shift_ptr + mod_row * shift_stride, scale_ptr + mod_row * scale_stride, cols, mask
        )
        _layer_norm_modulate_row(
            r.to(tl.float32), mask, cols, width, eps, shift, scale, y_ptr + row * width,
            q_ptr + row * width, inv_ptr, write_y, write_q,
        )  # fmt: skip


def index_arg(x: torch.Tensor, mod_index: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The index pointer and the per-token flag of a launch (a same-dtype dummy when per sample)."""
    return (dummy(x.device, torch.int32), 0) if mod_index is None else (mod_index, 1)


def _layer_norm_modulate_ok(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
    mod_index: torch.Tensor | None = None,
) -> bool:
    rows = [(shift, torch.bfloat16), (scale, torch.bfloat16)]
    return row_producer_ok(_layer_norm_modulate_kernel, [x], rows, mod_index, inv_scale)


def _launch_layer_norm_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Producer 1's binary on guarded inputs (same returns as the twin)."""
    write_q = inv_scale is not None
    if not (write_y or write_q):
        return None, None
    y, q, inv = row_outputs(x, inv_scale, write_y)
    index, per_token = index_arg(x, mod_index)
    grid, options = row_launch(x)
    _layer_norm_modulate_kernel[grid](
        x, shift, scale, index, y, q, inv, x.shape[1], x.shape[2], shift.stride(0), scale.stride(0), eps,
        int(write_y), int(write_q), per_token, **options,
    )  # fmt: skip
    return (y if write_y else None), (q if write_q else None)


def _residual_producer_ok(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
    mod_index: torch.Tensor | None = None,
) -> bool:
    kernel = _gated_residual_layer_norm_modulate_kernel
    rows = [(gate, torch.bfloat16), (shift, torch.bfloat16), (scale, torch.bfloat16)]
    return row_producer_ok(kernel, [residual, x], rows, mod_index, inv_scale)


def _launch_residual_producer(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Producer 2's binary on guarded inputs (same returns as the twin)."""
    write_q = inv_scale is not None
    r = torch.empty_like(residual)
    y, q, inv = row_outputs(residual, inv_scale, write_y)
    index, per_token = index_arg(residual, mod_index)
    grid, options = row_launch(residual)
    _gated_residual_layer_norm_modulate_kernel[grid](
        residual, gate, x, shift, scale, index, r, y, q, inv, residual.shape[1], residual.shape[2],
        gate.stride(0), shift.stride(0), scale.stride(0), eps, int(write_y), int(write_q), per_token,
        **options,
    )  # fmt: skip
    return r, (y if write_y else None), (q if write_q else None)


def _gated_residual_ok(
    residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, mod_index: torch.Tensor | None = None
) -> bool:
    return _residual_producer_ok(residual, gate, x, gate, gate, 0.0, write_y=False, mod_index=mod_index)


def _launch_gated_residual(
    residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, mod_index: torch.Tensor | None = None
) -> torch.Tensor:
    """Producer 2's binary with y and q off (no LN is run)."""
    return _launch_residual_producer(residual, gate, x, gate, gate, 0.0, write_y=False, mod_index=mod_index)[
        0
    ]


# Producer 1, producer 2, and the gated residual alone (after the MLP): Triton on CUDA when the guard
# accepts, else the torch twin (always on CPU).
layer_norm_modulate = FusedOp(layer_norm_modulate_torch, _launch_layer_norm_modulate, _layer_norm_modulate_ok)
gated_residual_layer_norm_modulate = FusedOp(
    gated_residual_layer_norm_modulate_torch, _launch_residual_producer, _residual_producer_ok
)
gated_residual = FusedOp(gated_residual_torch, _launch_gated_residual, _gated_residual_ok)
layer_norm_modulate_triton = layer_norm_modulate.triton
gated_residual_layer_norm_modulate_triton = gated_residual_layer_norm_modulate.triton
gated_residual_triton = gated_residual.triton
