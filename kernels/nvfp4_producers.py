"""LayerNorm + AdaLN modulate + NVFP4 activation quant, and its gated-residual form: the producers that feed
Blackwell's W4A4 GEMM (DESIGN §19), torch twins and Triton kernels.

Producer 1: `y = modulate(LN(x), shift, scale)`; producer 2: `r = residual + gate * x`, then `y` of `r`;
both as DESIGN §4 defines them (kernels/norm_modulate.py: the same twins and the same row arithmetic),
then `y` quantized to NVFP4 under the global encode scale (kernels/nvfp4_quant.py: packed E2M1 codes and
swizzled E4M3 block scales for `torch._scaled_mm`). Each kernel is one binary whose outputs (y, q) are
runtime flags, so the unfused NVFP4 path (this binary writes y, the consumer quantizes it) and the fused one
(it writes q) run the same LN reduction and give the same bytes; the consumer-side quantizer is the very
`store_nvfp4_row` the fused producers call. Modulation rows per sample, or per token through `mod_index`.
"""

import torch

from qwen_image_fusion.kernels._triton_common import FusedOp, dummy, jit, row_launch, row_producer_ok, tl
from qwen_image_fusion.kernels.norm_modulate import (
    gated_residual_torch,
    index_arg,
    layer_norm_modulate_row,
    layer_norm_torch,
    load_modulation,
    modulate_torch,
    modulation_row,
)
from qwen_image_fusion.kernels.nvfp4 import NVFP4_BLOCK
from qwen_image_fusion.kernels.nvfp4_quant import (
    nvfp4_outputs,
    nvfp4_quant_torch,
    store_nvfp4_row,
    swizzled_shape,
)

Quantized = tuple[torch.Tensor | None, torch.Tensor | None]


def layer_norm_modulate_nvfp4_torch(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    encode_scale: torch.Tensor | None,
    write_y: bool = True,
    write_q: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Producer 1's twin: `(y or None, q or None, block scales or None)`; q [B*L, D/2] packed codes, the
    block scales in `torch._scaled_mm`'s NVFP4 layout."""
    y = modulate_torch(layer_norm_torch(x, eps), shift, scale, mod_index)
    q, s = nvfp4_quant_torch(y, encode_scale) if write_q else (None, None)
    return (y if write_y else None), q, s


def gated_residual_layer_norm_modulate_nvfp4_torch(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    encode_scale: torch.Tensor | None,
    write_y: bool = True,
    write_q: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Producer 2's twin: `(r, y or None, q or None, block scales or None)`."""
    r = gated_residual_torch(residual, gate, x, mod_index)
    return r, *layer_norm_modulate_nvfp4_torch(
        r, shift, scale, eps, encode_scale, write_y, write_q, mod_index
    )


@jit()
def _finish_row(
    y, row, width, cols, mask, y_ptr, q_ptr, s_ptr, g_ptr, scale_tiles, write_y, write_q, BLOCK: tl.constexpr
):
    """Store y and/or its NVFP4 codes and block scales of one row."""
    if write_y != 0:
        tl.store(y_ptr + row * width + cols, y, mask=mask)
    if write_q != 0:
        store_nvfp4_row(y, row, width, q_ptr, s_ptr, g_ptr, scale_tiles, BLOCK)


@jit(do_not_specialize=["write_y", "write_q", "per_token"])
def _layer_norm_modulate_nvfp4_kernel(
    x_ptr, shift_ptr, scale_ptr, index_ptr, y_ptr, q_ptr, s_ptr, g_ptr,
    seq_len, width, shift_stride, scale_stride, eps, scale_tiles, write_y, write_q, per_token,
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
    y = layer_norm_modulate_row(v, mask, width, eps, shift, scale)
    _finish_row(y, row, width, cols, mask, y_ptr, q_ptr, s_ptr, g_ptr, scale_tiles, write_y, write_q, BLOCK)


@jit(do_not_specialize=["write_y", "write_q", "per_token"])
def _gated_residual_layer_norm_modulate_nvfp4_kernel(
    res_ptr, gate_ptr, x_ptr, shift_ptr, scale_ptr, index_ptr, r_ptr, y_ptr, q_ptr, s_ptr, g_ptr,
    seq_len, width, gate_stride, shift_stride, scale_stride, eps, scale_tiles, write_y, write_q, per_token,
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
    shift, scale = load_modulation(
        shift_ptr + mod_row * shift_stride, scale_ptr + mod_row * scale_stride, cols, mask
    )
    y = layer_norm_modulate_row(r.to(tl.float32), mask, width, eps, shift, scale)
    _finish_row(y, row, width, cols, mask, y_ptr, q_ptr, s_ptr, g_ptr, scale_tiles, write_y, write_q, BLOCK)


def _encode_scale_ok(encode_scale: torch.Tensor | None, write_q: bool, device: torch.device) -> bool:
    """A one-element fp32 encode scale on `device`, or none where q is not written."""
    if encode_scale is None:
        return not write_q
    return encode_scale.dtype == torch.float32 and encode_scale.numel() == 1 and encode_scale.device == device


def _outputs(
    x: torch.Tensor, encode_scale: torch.Tensor | None, write_y: bool, write_q: bool
) -> tuple[torch.Tensor, ...]:
    """y, q, block scales, the encode scale and the scale layout's column tiles to pass (same-dtype dummies
    where not written or given; the tiles from the width, so every mode specializes alike: one binary)."""
    rows, width = x.shape[0] * x.shape[1], x.shape[2]
    scale_tiles = swizzled_shape(rows, width // NVFP4_BLOCK)[1] // 4
    y = torch.empty_like(x) if write_y else dummy(x.device, torch.bfloat16)
    if write_q:
        q, s = nvfp4_outputs(rows, width, x.device)
    else:
        q, s = dummy(x.device, torch.uint8), dummy(x.device, torch.uint8).view(torch.float8_e4m3fn)
    g = dummy(x.device, torch.float32) if encode_scale is None else encode_scale
    return y, q, s, g, scale_tiles


def _results(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor, write_y: bool, write_q: bool) -> tuple:
    return (y if write_y else None), (q if write_q else None), (s if write_q else None)


def _layer_norm_modulate_nvfp4_ok(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    encode_scale: torch.Tensor | None,
    write_y: bool = True,
    write_q: bool = True,
    mod_index: torch.Tensor | None = None,
) -> bool:
    rows = [(shift, torch.bfloat16), (scale, torch.bfloat16)]
    kernel = _layer_norm_modulate_nvfp4_kernel
    return row_producer_ok(kernel, [x], rows, mod_index, None) and _encode_scale_ok(
        encode_scale, write_q, x.device
    )


def _launch_layer_norm_modulate_nvfp4(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    encode_scale: torch.Tensor | None,
    write_y: bool = True,
    write_q: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    y, q, s, g, scale_tiles = _outputs(x, encode_scale, write_y, write_q)
    index, per_token = index_arg(x, mod_index)
    grid, options = row_launch(x)
    _layer_norm_modulate_nvfp4_kernel[grid](
        x, shift, scale, index, y, q, s.view(torch.uint8), g, x.shape[1], x.shape[2],
        shift.stride(0), scale.stride(0), eps, scale_tiles, int(write_y), int(write_q), per_token,
        **options,
    )  # fmt: skip
    return _results(y, q, s, write_y, write_q)


def _residual_nvfp4_ok(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    encode_scale: torch.Tensor | None,
    write_y: bool = True,
    write_q: bool = True,
    mod_index: torch.Tensor | None = None,
) -> bool:
    kernel = _gated_residual_layer_norm_modulate_nvfp4_kernel
    rows = [(gate, torch.bfloat16), (shift, torch.bfloat16), (scale, torch.bfloat16)]
    ok = row_producer_ok(kernel, [residual, x], rows, mod_index, None)
    return ok and _encode_scale_ok(encode_scale, write_q, residual.device)


def _launch_residual_nvfp4(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    encode_scale: torch.Tensor | None,
    write_y: bool = True,
    write_q: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    r = torch.empty_like(residual)
    y, q, s, g, scale_tiles = _outputs(residual, encode_scale, write_y, write_q)
    index, per_token = index_arg(residual, mod_index)
    grid, options = row_launch(residual)
    _gated_residual_layer_norm_modulate_nvfp4_kernel[grid](
        residual, gate, x, shift, scale, index, r, y, q, s.view(torch.uint8), g,
        residual.shape[1], residual.shape[2], gate.stride(0), shift.stride(0), scale.stride(0), eps,
        scale_tiles, int(write_y), int(write_q), per_token, **options,
    )  # fmt: skip
    return r, *_results(y, q, s, write_y, write_q)


# Producer 1 and producer 2 for NVFP4 consumers: Triton on CUDA when the guard accepts, else the twin.
layer_norm_modulate_nvfp4 = FusedOp(
    layer_norm_modulate_nvfp4_torch, _launch_layer_norm_modulate_nvfp4, _layer_norm_modulate_nvfp4_ok
)
gated_residual_layer_norm_modulate_nvfp4 = FusedOp(
    gated_residual_layer_norm_modulate_nvfp4_torch, _launch_residual_nvfp4, _residual_nvfp4_ok
)
layer_norm_modulate_nvfp4_triton = layer_norm_modulate_nvfp4.triton
gated_residual_layer_norm_modulate_nvfp4_triton = gated_residual_layer_norm_modulate_nvfp4.triton
