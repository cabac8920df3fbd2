"""Our own FP8 GEMM candidates (issue 53 parts 2-3): Triton kernels for the DiT's block linears and the torch
twin they are checked against. Not wired into the model: `bench/fp8_gemm_bench.py` measures them against
`torch._scaled_mm` (cuBLASLt) first.

Contract, for E4M3 `a` [M, K] (row-major), the weight `w` [N, K] (row-major, as ModelOpt stores it), fp32
one-element `scale_a`, `scale_b` and an optional bf16 `bias` [N]:
  acc = a @ w.T in fp32 (the kernels sum in their own order; the twin sums exactly, see below);
  h = bf16((acc * (scale_a * scale_b)) + fp32(bias)), each fp32 op rounded on its own (no FMA);
  with `inv_scale` (the MLP up-projection): q = gelu_tanh_quant(h, inv_scale), the GELU(tanh) + static FP8
  quantization of kernels/gelu_quant.py, computed in the epilogue by the same jitted helpers
  (`gelu_tanh_bf16`, `quant_fp8`) that kernel uses, so fused GEMM + GELU + quant == the GEMM's own bf16
  output fed to `gelu_tanh_quant`, byte for byte.
The twin sums the dot products in float64, which is exact for E4M3 inputs while K <= 2^17 (each product is a
multiple of 2^-18 below 2^18), and rounds once to fp32: the kernels' fp32 sums differ from it by their
summation order (and, with Hopper's fast FP8 accumulation, by its truncated accumulator).

Candidates (all take the same arguments; `GemmConfig` names the tile and pipeline):
- `tiled`: one program per output tile, pointer loads, GROUP_M swizzle of the tile order (Triton's
  tutorial 03 shape);
- `persistent`: one program per SM walking the tiles, TMA tensor descriptors (`tl.make_tensor_descriptor`,
  which needs `triton.set_allocator`) for the loads and the store;
- `persistent` with `warp_specialize=True`: the same loop as `tl.range(..., warp_specialize=True)` (Triton
  >= 3.4 exposes the flag; whether a given Triton compiles it for sm_90 is what the benchmark finds out).
`precise=True` promotes the FP8 tensor-core partial sums to the fp32 accumulator every BLOCK_K elements
(`max_num_imprecise_acc=BLOCK_K`), as cuBLASLt does without `use_fast_accum`; `precise=False` is Triton's
default on sm_90 (the tensor core's own accumulator over all of K), the analogue of `use_fast_accum=True`.
"""

import functools
from dataclasses import dataclass

import torch

from qwen_image_fusion.kernels._triton_common import (
    FP8_DTYPE,
    NO_FMA,
    dummy,
    interpreted,
    inverse_scale_ok,
    jit,
    launchable,
    tl,
    triton,
)
from qwen_image_fusion.kernels.gelu_quant import gelu_tanh_bf16, gelu_tanh_quant_torch
from qwen_image_fusion.kernels.quant import exact_fp8_dot, quant_fp8

KERNELS = ("tiled", "persistent")


@dataclass(frozen=True)
class GemmConfig:
    """One candidate's tile and pipeline: block sizes, GROUP_M swizzle, software-pipeline stages, warps,
    accumulation mode and (persistent kernel only) warp specialization."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    stages: int = 4
    warps: int = 8
    precise: bool = True
    warp_specialize: bool = False

    def name(self) -> str:
        acc = "precise" if self.precise else "fast"
        ws = "-ws" if self.warp_specialize else ""
        tile = f"{self.block_m}x{self.block_n}x{self.block_k}"
        return f"{tile}-g{self.group_m}-s{self.stages}-w{self.warps}-{acc}{ws}"


# ---------------------------------------------------------------------------------------------- the twin


def fp8_gemm_torch(
    a: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    inv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The contract above in torch: bf16 h [M, N], or with `inv_scale` the E4M3 q = GELU + quant of h."""
    scale = scale_a.float().reshape(()) * scale_b.float().reshape(())
    h = exact_fp8_dot(a, w) * scale
    if bias is not None:
        h = h + bias.float()
    h = h.to(torch.bfloat16)
    return h if inv_scale is None else gelu_tanh_quant_torch(h, inv_scale)


# ----------------------------------------------------------------------------------------- device helpers


@jit()
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Output tile `tile` -> (pid_m, pid_n), GROUP_M row tiles at a time (L2 reuse of the weight tiles)."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_rows
    pid_n = (tile % in_group) // group_rows
    return pid_m, pid_n


@jit()
def _mma(a, b, acc, PRECISE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a @ b.T; PRECISE: the partial sums promoted to fp32 every BLOCK_K (cuBLASLt's default)."""
    return tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K) if PRECISE else tl.dot(a, b.T, acc)


@jit()
def _epilogue(
    acc, offs_n, N, scale_a_ptr, scale_b_ptr, bias_ptr, inv_ptr,
    HAS_BIAS: tl.constexpr, GELU_QUANT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The contract's h (bf16), or q = GELU + FP8 quant of h (the helpers of kernels/gelu_quant.py)."""
    h = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    if HAS_BIAS:
        h = h + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out = h.to(tl.bfloat16)
    if GELU_QUANT:  # one return: Triton 3.6 refuses branches returning different types, constexpr or not
        out = quant_fp8(gelu_tanh_bf16(out.to(tl.float32), INTERPRET), inv_ptr)
    return out


# ------------------------------------------------------------------------------------------------ kernels


@jit()
def _fp8_gemm_tiled_kernel(
    a_ptr, w_ptr, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, inv_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU_QUANT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past M / N read a valid row (modulo) and are never stored: no mask in the main loop's M / N
    a_ptrs = a_ptr + (offs_m % M)[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + (offs_n % N)[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        acc = _mma(a, b, acc, PRECISE, BLOCK_K)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = _epilogue(
        acc, offs_n, N, scale_a_ptr, scale_b_ptr, bias_ptr, inv_ptr, HAS_BIAS, GELU_QUANT, INTERPRET
    )
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], out, mask=mask)


@jit()
def _fp8_gemm_persistent_kernel(
    a_ptr, w_ptr, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, inv_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU_QUANT: tl.constexpr, INTERPRET: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    # TMA descriptors: out-of-range rows / columns load as zeros and are not stored
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    start = tl.program_id(0)
    # the epilogue's tile is recomputed from its own counter (Triton's tutorial 09): the loop-carried
    # tile of the main loop stays with the producer when the loop is warp-specialized
    tile_c = start - NUM_PROGRAMS
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = _mma(a, b, acc, PRECISE, BLOCK_K)
        tile_c += NUM_PROGRAMS
        pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = _epilogue(
            acc, offs_n, N, scale_a_ptr, scale_b_ptr, bias_ptr, inv_ptr, HAS_BIAS, GELU_QUANT, INTERPRET
        )
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)


# ------------------------------------------------------------------------------------------------ launches


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cpu":
        return 4  # the interpreter: a few programs, each walking several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_alloc(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-side tensor descriptors (`tl.make_tensor_descriptor`), on the current
    device (the launch runs there)."""
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def set_tma_allocator() -> None:
    """`triton.set_allocator`, which `tl.make_tensor_descriptor` needs on a GPU (idempotent)."""
    triton.set_allocator(_tma_alloc)


def fp8_gemm_ok(
    a: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    inv_scale: torch.Tensor | None = None,
) -> bool:
    """Guard: contiguous E4M3 a [M, K] and w [N, K], K and N multiples of 16 (TMA strides, as `_scaled_mm`),
    int32-indexable sizes, one-element fp32 scales, a bf16 [N] bias, all on a device the kernels run on."""
    tensors = [a, w, scale_a, scale_b, *([] if bias is None else [bias])]
    if not launchable(_fp8_gemm_tiled_kernel, *tensors) or a.dim() != 2 or w.dim() != 2:
        return False
    (m, k), (n, k_w) = a.shape, w.shape
    if k != k_w or m == 0 or k % 16 or n % 16 or max(m, n) * max(k, n) >= 2**31:
        return False
    if a.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE or not (a.is_contiguous() and w.is_contiguous()):
        return False
    if any(s.dtype != torch.float32 or s.numel() != 1 for s in (scale_a, scale_b)):
        return False
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()):
        return False
    return inv_scale is None or inverse_scale_ok(inv_scale, a.device)


def fp8_gemm_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    inv_scale: torch.Tensor | None = None,
    *,
    kernel: str = "tiled",
    config: GemmConfig = GemmConfig(),
) -> torch.Tensor | None:
    """One candidate on guarded inputs: bf16 h [M, N], or E4M3 q with `inv_scale`; None where the guard
    rejects them. The GELU + quant variant launches with the options of kernels/gelu_quant.py's kernel."""
    if not fp8_gemm_ok(a, w, scale_a, scale_b, bias, inv_scale):
        return None
    if kernel not in KERNELS:
        raise ValueError(f"FP8 GEMM: kernel {kernel!r} is not one of {KERNELS}")
    (m, k), n = a.shape, w.shape[0]
    device = a.device
    gelu_quant = inv_scale is not None
    out = torch.empty(m, n, dtype=FP8_DTYPE if gelu_quant else torch.bfloat16, device=device)
    bias_arg = dummy(device, torch.bfloat16) if bias is None else bias
    inv_arg = inv_scale if gelu_quant else dummy(device, torch.float32)
    c = config
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    impl = _fp8_gemm_tiled_kernel if kernel == "tiled" else _fp8_gemm_persistent_kernel
    meta = dict(
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, PRECISE=c.precise,
        HAS_BIAS=bias is not None, GELU_QUANT=gelu_quant, INTERPRET=interpreted(impl),
        num_stages=c.stages, num_warps=c.warps, **NO_FMA,
    )  # fmt: skip
    if gelu_quant:
        meta["enable_reflect_ftz"] = False  # as `_launch_gelu`: libdevice tanhf without flush to zero
    if kernel == "tiled":
        if c.warp_specialize:
            raise ValueError("FP8 GEMM: warp specialization is a persistent-kernel option")
        grid = (tiles,)
    else:
        if device.type == "cuda":
            set_tma_allocator()
        programs = min(_num_sms(device), tiles)
        meta.update(NUM_PROGRAMS=programs, WARP_SPECIALIZE=c.warp_specialize)
        grid = (programs,)
    impl[grid](a, w, out, scale_a, scale_b, bias_arg, inv_arg, m, n, k, **meta)
    return out


def warp_specialize_available() -> bool:
    """This Triton's `tl.range` takes `warp_specialize` (3.4 and later); whether the backend compiles it for
    the device is a separate question the benchmark answers by trying."""
    if triton is None:
        return False
    import inspect

    return "warp_specialize" in inspect.signature(tl.range.__init__).parameters
