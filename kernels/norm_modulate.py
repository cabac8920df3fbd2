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

from kernels._triton_common import NO_FMA, dummy, inverse_scale_ok, jit, launchable, tl, triton
from kernels.fp32 import div_rn, row_sum, sqrt_rn
from kernels.quant import FP8_DTYPE, quant_fp8, static_quant_fp8_torch

MAX_WIDTH = 16384


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
def _modulation_row(row, seq_len, index_ptr, per_token):
    """The modulation row of activation row `row`: its sample, or `mod_index[row]` when `per_token`."""
    mod_row = row // seq_len
    if per_token != 0:
        mod_row = tl.load(index_ptr + row).to(tl.int64)
    return mod_row


@jit()
def _load_modulation(shift_ptr, scale_ptr, cols, mask):
    """fp32 shift and scale of one modulation row, loaded before the LN sums so their latency overlaps."""
    shift = tl.load(shift_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return shift, scale


@jit()
def _layer_norm_modulate_row(
    v, mask, cols, width, eps, shift, scale, y_ptr, q_ptr, inv_ptr, write_y, write_q
):
    """LN + modulate of one fp32 row `v` (zero past `width`); stores y and/or q. Pointers at the row."""
    width_f = width.to(tl.float32)
    mean = tl.math.div_rn(tl.sum(v, axis=0), width_f)
    centered = tl.where(mask, v - mean, 0.0)
    var = tl.math.div_rn(tl.sum(centered * centered, axis=0), width_f)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    normed = (centered * rstd).to(tl.bfloat16)
    y = (normed.to(tl.float32) * (1.0 + scale) + shift).to(tl.bfloat16)
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
    mod_row = _modulation_row(row, seq_len, index_ptr, per_token)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    v = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    shift, scale = _load_modulation(
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
    mod_row = _modulation_row(row, seq_len, index_ptr, per_token)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    offs = row * width + cols
    res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + mod_row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = (res + gate * x).to(tl.bfloat16)
    tl.store(r_ptr + offs, r, mask=mask)
    if (write_y | write_q) != 0:
        shift, scale = _load_modulation(
            shift_ptr + mod_row * shift_stride, scale_ptr + mod_row * scale_stride, cols, mask
        )
        _layer_norm_modulate_row(
            r.to(tl.float32), mask, cols, width, eps, shift, scale, y_ptr + row * width,
            q_ptr + row * width, inv_ptr, write_y, write_q,
        )  # fmt: skip


def _row_launch(x: torch.Tensor) -> tuple[tuple[int], dict]:
    """Grid (one program per row) and options: BLOCK = next power of two >= D, no FMA, and 32 elements a
    thread (4 warps at D = 3072: ~10% faster on H200 than 8 warps, 25% than 16)."""
    block = triton.next_power_of_2(x.shape[-1])
    return (x.shape[0] * x.shape[1],), {"BLOCK": block, "num_warps": max(4, min(16, block // 1024)), **NO_FMA}


def _producer_ok(
    kernel, acts: list[torch.Tensor], mods: list[torch.Tensor], inv_scale, mod_index: torch.Tensor | None
) -> bool:
    """Guard: bf16 contiguous [B, L, D] activations, D % 16 == 0, bf16 rows with unit column stride: [B, D],
    or [R, D] (R >= 1) with a contiguous int32 [B, L] `mod_index` (its values in [0, R) are the caller's
    promise: checking them would sync with the host)."""
    x = acts[0]
    index = [] if mod_index is None else [mod_index]
    if not launchable(kernel, *acts, *mods, *index) or x.dim() != 3 or x.numel() == 0:
        return False
    batch, seq, width = x.shape
    if width % 16 or width > MAX_WIDTH:
        return False
    if any(a.dtype != torch.bfloat16 or a.shape != x.shape or not a.is_contiguous() for a in acts):
        return False
    rows = batch if mod_index is None else mods[0].shape[0] if mods[0].dim() == 2 else 0
    if rows < 1 or any(
        m.dtype != torch.bfloat16 or m.shape != (rows, width) or m.stride(1) != 1 for m in mods
    ):
        return False
    if mod_index is not None and not (
        mod_index.dtype == torch.int32 and mod_index.shape == (batch, seq) and mod_index.is_contiguous()
    ):
        return False
    return inv_scale is None or inverse_scale_ok(inv_scale, x.device)


def _index_arg(x: torch.Tensor, mod_index: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The index pointer and the per-token flag of a launch (a same-dtype dummy when per sample)."""
    return (dummy(x.device, torch.int32), 0) if mod_index is None else (mod_index, 1)


def _outputs(x: torch.Tensor, inv_scale, write_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y, q and the inverse scale to pass: real tensors where written, same-dtype dummies elsewhere."""
    device = x.device
    y = torch.empty_like(x) if write_y else dummy(device, torch.bfloat16)
    if inv_scale is None:
        return y, dummy(device, FP8_DTYPE), dummy(device, torch.float32)
    return y, torch.empty_like(x, dtype=FP8_DTYPE), inv_scale


def layer_norm_modulate_triton(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """Triton twin of `layer_norm_modulate_torch` (same returns); None when the guard rejects the input."""
    if not _producer_ok(_layer_norm_modulate_kernel, [x], [shift, scale], inv_scale, mod_index):
        return None
    write_q = inv_scale is not None
    if not (write_y or write_q):
        return None, None
    y, q, inv = _outputs(x, inv_scale, write_y)
    index, per_token = _index_arg(x, mod_index)
    grid, options = _row_launch(x)
    _layer_norm_modulate_kernel[grid](
        x, shift, scale, index, y, q, inv, x.shape[1], x.shape[2], shift.stride(0), scale.stride(0), eps,
        int(write_y), int(write_q), per_token, **options,
    )  # fmt: skip
    return (y if write_y else None), (q if write_q else None)


def gated_residual_layer_norm_modulate_triton(
    residual: torch.Tensor,
    gate: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """Triton twin of `gated_residual_layer_norm_modulate_torch` (same returns); None when rejected."""
    kernel = _gated_residual_layer_norm_modulate_kernel
    if not _producer_ok(kernel, [residual, x], [gate, shift, scale], inv_scale, mod_index):
        return None
    write_q = inv_scale is not None
    r = torch.empty_like(residual)
    y, q, inv = _outputs(residual, inv_scale, write_y)
    index, per_token = _index_arg(residual, mod_index)
    grid, options = _row_launch(residual)
    kernel[grid](
        residual, gate, x, shift, scale, index, r, y, q, inv, residual.shape[1], residual.shape[2],
        gate.stride(0), shift.stride(0), scale.stride(0), eps, int(write_y), int(write_q), per_token,
        **options,
    )  # fmt: skip
    return r, (y if write_y else None), (q if write_q else None)


def gated_residual_triton(
    residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, mod_index: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Triton twin of `gated_residual_torch`: the producer-2 binary with y and q off (no LN is run)."""
    out = gated_residual_layer_norm_modulate_triton(
        residual, gate, x, gate, gate, 0.0, write_y=False, mod_index=mod_index
    )
    return None if out is None else out[0]


def layer_norm_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    inv_scale: torch.Tensor | None = None,
    write_y: bool = True,
    mod_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Producer 1 through Triton on CUDA when the guard accepts, else the torch twin (always on CPU)."""
    args = (x, shift, scale, eps, inv_scale, write_y, mod_index)
    out = layer_norm_modulate_triton(*args) if x.is_cuda else None
    return layer_norm_modulate_torch(*args) if out is None else out


def gated_residual_layer_norm_modulate(
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
    """Producer 2 through Triton on CUDA when the guard accepts, else the torch twin (always on CPU)."""
    args = (residual, gate, x, shift, scale, eps, inv_scale, write_y, mod_index)
    out = gated_residual_layer_norm_modulate_triton(*args) if residual.is_cuda else None
    return gated_residual_layer_norm_modulate_torch(*args) if out is None else out


def gated_residual(
    residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, mod_index: torch.Tensor | None = None
) -> torch.Tensor:
    """`r = residual + gate * x` through Triton on CUDA when the guard accepts, else the torch twin."""
    r = gated_residual_triton(residual, gate, x, mod_index) if residual.is_cuda else None
    return gated_residual_torch(residual, gate, x, mod_index) if r is None else r
