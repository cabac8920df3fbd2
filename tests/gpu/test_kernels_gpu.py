"""Compiled Triton kernels on CUDA against the torch twins and against themselves (DESIGN §4).

- quantizer: byte-exact vs the CUDA twin on all 65536 bf16 encodings x 8 scales, and vs the CPU twin
  (itself checked against a bit-level encoder) except for the sign of NaN;
- both producers and GELU, at rows {1, 127, 1024, 4096} x hidden {3072, 1536, 5120}, inputs holding every
  bf16 encoding plus normal data: fused == unfused byte for byte and from the same compiled binary;
  r equal to the twin's (NaN where NaN); y explained by LN statistics within the sum-order slack, and
  differing from the twin in at most 1e-4 of the values; g within tanh's last-bit slack of the contract;
  q == the quantizer of the kernel's own y / g, byte-exact;
- both producers with per-token modulation rows (`mod_index`, Edit-2511's `zero_cond_t`), at rows
  {1, 127, 1024, 4096, 8192} x the same widths, every bf16 encoding in the activations and in the shift /
  scale / gate rows (every row reached), and Edit-2511's layout (target rows, then reference rows on the
  t = 0 modulation): the same checks, for each of the 8 input scales, per-token launches reusing the
  per-sample binary; an index naming each token's own sample gives the per-sample bytes.
Mismatch counts vs the twins are printed (run with -s).
"""

import pytest
import torch
from steps import step_distance
from test_kernels_gelu import within_tanh_slack
from test_kernels_norm_modulate import EPS, explained_by_ln_statistics
from test_kernels_quant import INPUT_SCALES, all_bf16

import qwen_image_fusion.kernels.norm_modulate as norm_modulate
from qwen_image_fusion.kernels.gelu_quant import (
    _gelu_tanh_quant_kernel,
    gelu_tanh_quant_triton,
    gelu_tanh_torch,
    gelu_tanh_triton,
)
from qwen_image_fusion.kernels.norm_modulate import (
    _gated_residual_layer_norm_modulate_kernel,
    _layer_norm_modulate_kernel,
    gated_residual_layer_norm_modulate_torch,
    gated_residual_layer_norm_modulate_triton,
    gated_residual_triton,
    layer_norm_modulate,
    layer_norm_modulate_torch,
    layer_norm_modulate_triton,
)
from qwen_image_fusion.kernels.quant import inverse_scale, static_quant_fp8_torch, static_quant_fp8_triton

pytestmark = pytest.mark.gpu
ROWS = [1, 127, 1024, 4096]
WIDTHS = [3072, 1536, 5120]
CASES = [(rows, width) for rows in ROWS for width in WIDTHS]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def binaries(kernel) -> int:
    """Compiled variants of `kernel` on the current device (Triton's per-device kernel cache)."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


def noise(like: torch.Tensor, seed: int) -> torch.Tensor:
    """bf16 values 3 x N(0, 1) in `like`'s shape, the same on every run (the twin comparisons count
    differences, so their inputs must not change between runs)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (3 * torch.randn(like.shape, device="cuda", generator=g)).bfloat16()


def activations(rows: int, width: int, seed: int) -> torch.Tensor:
    """[B, L, D] bf16 rows of varied mean and spread; with room, the first 65536 values are every encoding."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = 2 if rows % 2 == 0 else 1
    shape = (batch, rows // batch, width)
    spread = torch.exp(torch.randn(*shape[:2], 1, device="cuda", generator=g))
    offset = 4 * torch.randn(*shape[:2], 1, device="cuda", generator=g)
    x = (torch.randn(shape, device="cuda", generator=g) * spread + offset).bfloat16()
    if x.numel() >= 2 * (1 << 16):
        x.view(-1)[: 1 << 16] = all_bf16().cuda()
    return x


def modulation(batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, shift, scale as strided chunks of one [B, 6D] tensor, like the model's modulation output."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    mod = (0.5 * torch.randn(batch, 6 * width, device="cuda", generator=g)).bfloat16()
    return mod[:, :width], mod[:, 3 * width : 4 * width], mod[:, 4 * width : 5 * width]


def safe_rows(t: torch.Tensor) -> torch.Tensor:
    """[B, L, 1] mask of rows whose LN sums cannot overflow fp32 in any order (finite, moderate)."""
    t64 = t.double()
    return (t64.abs().sum(-1, keepdim=True) < 1e37) & ((t64 * t64).sum(-1, keepdim=True) < 1e37)


def report(tag: str, got: torch.Tensor, want: torch.Tensor, rows_ok: torch.Tensor) -> int:
    """Print and return how many values of `got` differ from `want` (NaN == NaN) in the rows_ok rows."""
    dist = step_distance(got, want)
    ok = rows_ok.expand_as(dist)
    bad = int((dist[ok] > 0).sum())
    worst = int(dist[ok].max()) if bad else 0
    print(
        f"{tag}: {bad} of {int(ok.sum())} differ (max {worst} steps); "
        f"{int((dist[~ok] > 0).sum())} in {int((~rows_ok).sum())} overflow-prone rows"
    )
    return bad


def check_producer_against_twin(
    tag: str,
    ln_input: torch.Tensor,
    fused: tuple[torch.Tensor, torch.Tensor],
    twin: tuple[torch.Tensor, torch.Tensor],
    shift: torch.Tensor,
    scale: torch.Tensor,
    inv: torch.Tensor,
    mod_index: torch.Tensor | None = None,
) -> None:
    """A producer's (y, q) against its torch twin's: y differs in at most 1e-4 of the values and is
    explained by the LN statistics of `ln_input` in the overflow-safe rows (or NaN where the twin's is:
    modulation rows may hold NaN); q is the quantizer of y."""
    (y, q), (y_twin, q_twin) = fused, twin
    ok = safe_rows(ln_input)
    bad_y = report(f"{tag} y", y, y_twin, ok)
    report(f"{tag} q", q, q_twin, ok)
    assert bad_y <= max(8, y_twin.numel() // 10_000)
    explained = explained_by_ln_statistics(y, ln_input, shift, scale, False, mod_index) | (
        y.isnan() & y_twin.isnan()
    )
    assert bool(explained[ok.expand_as(y)].all())
    assert same_bytes(q, static_quant_fp8_torch(y, inv))


def test_quantizer_byte_exact_on_all_bf16():
    y = all_bf16()
    nan = y.isnan()
    for s in INPUT_SCALES:
        inv = inverse_scale(torch.tensor(s))
        got = static_quant_fp8_triton(y.cuda(), inv.cuda())
        assert got is not None
        assert same_bytes(got, static_quant_fp8_torch(y.cuda(), inv.cuda())), s
        # vs the CPU twin (checked against the bit-level encoder): the same bytes except at NaN inputs,
        # where the sign of the NaN may differ (a GPU multiply returns the canonical NaN)
        got, cpu = got.cpu().view(torch.uint8), static_quant_fp8_torch(y, inv).view(torch.uint8)
        differ = (got != cpu).nonzero().flatten()
        assert torch.equal(got[~nan], cpu[~nan]), (
            f"scale {s}: {y[differ[:4]]} -> {got[differ[:4]]} vs {cpu[differ[:4]]}"
        )
        assert bool(((got[nan] & 0x7F) == 0x7F).all()), s


def test_quantizer_reads_row_slices_without_a_copy():
    """The image rows of a joint [B, S, D] attention output, quantized in place of `.contiguous()` first."""
    joint = activations(2 * 4224, 3072, seed=11).view(2, 4224, 3072)
    inv = inverse_scale(torch.tensor(0.05)).cuda()
    for rows in (joint[:, 128:], joint[:, :128], joint[1:, 7:]):
        got = static_quant_fp8_triton(rows, inv)
        assert got is not None and got.is_contiguous()
        assert same_bytes(got, static_quant_fp8_torch(rows.contiguous(), inv))


@pytest.mark.parametrize("rows, width", CASES)
def test_producer1(rows, width):
    x = activations(rows, width, seed=rows + width)
    _, shift, scale = modulation(x.shape[0], width, seed=rows)
    inv = inverse_scale(torch.tensor(0.02, device="cuda"))
    args = (x, shift, scale, EPS)
    y_unfused, _ = layer_norm_modulate_triton(*args)
    q_unfused = static_quant_fp8_triton(y_unfused, inv)
    compiled = binaries(_layer_norm_modulate_kernel)
    y_fused, q_fused = layer_norm_modulate_triton(*args, inv)
    _, q_only = layer_norm_modulate_triton(*args, inv, write_y=False)
    assert binaries(_layer_norm_modulate_kernel) == compiled  # the fused launches reused the binary
    assert same_bytes(y_fused, y_unfused)
    assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)

    y_ref, q_ref = layer_norm_modulate_torch(*args, inv)
    check_producer_against_twin(
        f"p1 rows={rows} D={width}", x, (y_fused, q_fused), (y_ref, q_ref), shift, scale, inv
    )


@pytest.mark.parametrize("rows, width", CASES)
def test_producer2(rows, width):
    residual = activations(rows, width, seed=rows + width)
    x = noise(residual, seed=rows + width + 1000)
    gate, shift, scale = modulation(x.shape[0], width, seed=rows + 1)
    inv = inverse_scale(torch.tensor(0.05, device="cuda"))
    args = (residual, gate, x, shift, scale, EPS)
    kernel = _gated_residual_layer_norm_modulate_kernel
    r_unfused, y_unfused, _ = gated_residual_layer_norm_modulate_triton(*args)
    q_unfused = static_quant_fp8_triton(y_unfused, inv)
    compiled = binaries(kernel)
    r_fused, y_fused, q_fused = gated_residual_layer_norm_modulate_triton(*args, inv)
    r_only, _, q_only = gated_residual_layer_norm_modulate_triton(*args, inv, write_y=False)
    assert binaries(kernel) == compiled
    assert same_bytes(r_fused, r_unfused) and same_bytes(r_only, r_unfused)
    assert same_bytes(y_fused, y_unfused)
    assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)

    r_ref, y_ref, q_ref = gated_residual_layer_norm_modulate_torch(*args, inv)
    assert int(step_distance(r_fused, r_ref).max()) == 0  # no reduction: equal values, NaN where NaN
    check_producer_against_twin(
        f"p2 rows={rows} D={width}", r_fused, (y_fused, q_fused), (y_ref, q_ref), shift, scale, inv
    )


@pytest.mark.parametrize("rows, width", CASES)
def test_gelu(rows, width):
    h = activations(rows, width, seed=rows * width)
    inv = inverse_scale(torch.tensor(0.03125, device="cuda"))
    g_unfused = gelu_tanh_triton(h)
    q_unfused = static_quant_fp8_triton(g_unfused, inv)
    compiled = binaries(_gelu_tanh_quant_kernel)
    g_fused, q_fused = gelu_tanh_quant_triton(h, inv, write_g=True)
    _, q_only = gelu_tanh_quant_triton(h, inv)
    assert binaries(_gelu_tanh_quant_kernel) == compiled
    assert same_bytes(g_fused, g_unfused)
    assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)

    everywhere = torch.ones(*h.shape[:2], 1, dtype=torch.bool, device="cuda")
    report(f"gelu rows={rows} D={width} g", g_fused, gelu_tanh_torch(h), everywhere)
    assert bool(within_tanh_slack(g_fused, h, tol=0).all())
    assert same_bytes(q_fused, static_quant_fp8_torch(g_fused, inv))


PER_TOKEN_CASES = [
    (rows, width, layout)
    for rows in [*ROWS, 8192]
    for width in WIDTHS
    for layout in ("every row", "Edit-2511")
]


def every_encoding_rows(width: int, seed: int) -> torch.Tensor:
    """[R, D] bf16 modulation rows holding all 65536 encodings, shuffled (the last row's rest normal)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = -(-(1 << 16) // width)
    values = (0.5 * torch.randn(rows * width, device="cuda", generator=g)).bfloat16()
    values[: 1 << 16] = all_bf16().cuda()[torch.randperm(1 << 16, device="cuda", generator=g)]
    return values.view(rows, width)


def per_token_modulation(
    x: torch.Tensor, layout: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, shift, scale rows and the int32 [B, L] index: "every row": three [R, D] tensors of every
    encoding, tokens spread over all rows (each reached once there are R tokens); "Edit-2511": strided
    chunks of a [2B, 6D] modulation output, the first third of each sample's tokens on rows 0..B-1, the
    rest on the t = 0 rows B..2B-1."""
    batch, seq, width = x.shape
    if layout == "Edit-2511":
        gate, shift, scale = modulation(2 * batch, width, seed)
        reference = (torch.arange(seq, device="cuda") >= seq // 3).int()
        index = torch.arange(batch, dtype=torch.int32, device="cuda")[:, None] + batch * reference
        return gate, shift, scale, index.int().contiguous()
    gate, shift, scale = (every_encoding_rows(width, seed + k) for k in range(3))
    g = torch.Generator(device="cuda").manual_seed(seed)
    index = torch.randperm(batch * seq, device="cuda", generator=g) % gate.shape[0]
    return gate, shift, scale, index.view(batch, seq).int()


@pytest.mark.parametrize("rows, width, layout", PER_TOKEN_CASES)
def test_producer1_per_token(rows, width, layout):
    x = activations(rows, width, seed=rows + width + 7)
    _, shift, scale, index = per_token_modulation(x, layout, seed=rows)
    args = (x, shift, scale, EPS)
    layer_norm_modulate_triton(x, *modulation(x.shape[0], width, seed=rows)[1:], EPS)  # per sample
    compiled = binaries(_layer_norm_modulate_kernel)
    y_unfused, _ = layer_norm_modulate_triton(*args, mod_index=index)
    for s in INPUT_SCALES:
        inv = inverse_scale(torch.tensor(s, device="cuda"))
        q_unfused = static_quant_fp8_triton(y_unfused, inv)
        y_fused, q_fused = layer_norm_modulate_triton(*args, inv, mod_index=index)
        _, q_only = layer_norm_modulate_triton(*args, inv, write_y=False, mod_index=index)
        assert same_bytes(y_fused, y_unfused)
        assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused), s
    assert binaries(_layer_norm_modulate_kernel) == compiled  # per token, fused or not: the same binary

    y_ref, q_ref = layer_norm_modulate_torch(*args, inv, mod_index=index)
    check_producer_against_twin(
        f"p1 per token ({layout}) rows={rows} D={width}", x, (y_fused, q_fused), (y_ref, q_ref),
        shift, scale, inv, index,
    )  # fmt: skip


@pytest.mark.parametrize("rows, width, layout", PER_TOKEN_CASES)
def test_producer2_per_token(rows, width, layout):
    residual = activations(rows, width, seed=rows + width + 8)
    x = noise(residual, seed=rows + width + 1008)
    gate, shift, scale, index = per_token_modulation(x, layout, seed=rows + 1)
    args = (residual, gate, x, shift, scale, EPS)
    kernel = _gated_residual_layer_norm_modulate_kernel
    per_sample_gate, per_sample_shift, per_sample_scale = modulation(x.shape[0], width, seed=rows)
    gated_residual_layer_norm_modulate_triton(
        residual, per_sample_gate, x, per_sample_shift, per_sample_scale, EPS
    )
    compiled = binaries(kernel)
    r_unfused, y_unfused, _ = gated_residual_layer_norm_modulate_triton(*args, mod_index=index)
    for s in INPUT_SCALES:
        inv = inverse_scale(torch.tensor(s, device="cuda"))
        q_unfused = static_quant_fp8_triton(y_unfused, inv)
        r_fused, y_fused, q_fused = gated_residual_layer_norm_modulate_triton(*args, inv, mod_index=index)
        r_only, _, q_only = gated_residual_layer_norm_modulate_triton(
            *args, inv, write_y=False, mod_index=index
        )
        assert same_bytes(r_fused, r_unfused) and same_bytes(r_only, r_unfused)
        assert same_bytes(y_fused, y_unfused)
        assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused), s
    assert same_bytes(gated_residual_triton(residual, gate, x, index), r_unfused)
    assert binaries(kernel) == compiled

    r_ref, y_ref, q_ref = gated_residual_layer_norm_modulate_torch(*args, inv, mod_index=index)
    assert int(step_distance(r_fused, r_ref).max()) == 0  # no reduction: equal values, NaN where NaN
    check_producer_against_twin(
        f"p2 per token ({layout}) rows={rows} D={width}", r_fused, (y_fused, q_fused), (y_ref, q_ref),
        shift, scale, inv, index,
    )  # fmt: skip


def test_per_token_index_of_own_sample_gives_the_per_sample_bytes():
    x = activations(4096, 3072, seed=5)
    gate, shift, scale = modulation(x.shape[0], 3072, seed=6)
    own = torch.arange(x.shape[0], dtype=torch.int32, device="cuda")[:, None].expand(x.shape[:2]).contiguous()
    inv = inverse_scale(torch.tensor(0.02, device="cuda"))
    args = (x, gate, x.flip(1).contiguous(), shift, scale, EPS, inv)
    for got, want in zip(
        gated_residual_layer_norm_modulate_triton(*args, mod_index=own),
        gated_residual_layer_norm_modulate_triton(*args),
        strict=True,
    ):
        assert same_bytes(got, want)


def test_dispatch_on_cuda_uses_triton(monkeypatch):
    def no_twin(*_):
        raise AssertionError("CUDA input the guard accepts must not fall back to the torch twin")

    monkeypatch.setattr(norm_modulate, "layer_norm_modulate_torch", no_twin)
    x = activations(8, 3072, seed=1)
    _, shift, scale = modulation(x.shape[0], 3072, seed=2)
    inv = inverse_scale(torch.tensor(0.02, device="cuda"))
    y, q = layer_norm_modulate(x, shift, scale, EPS, inv)
    y_triton, q_triton = layer_norm_modulate_triton(x, shift, scale, EPS, inv)
    assert same_bytes(y, y_triton) and same_bytes(q, q_triton)
