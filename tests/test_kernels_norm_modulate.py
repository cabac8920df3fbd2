"""LN+modulate producers: torch twins vs float64; Triton (interpreter) fused vs unfused bit for bit, vs
the twins within the LN-statistics slack, and bit for bit vs tests/contract.py on rows with exact LN
statistics. The twins against the contract bit for bit: test_kernels_contract.py."""

import contract
import pytest
import torch
from steps import nudge_bf16, ordered_codes, step_distance
from test_kernels_quant import interpreter_exact_range, needs_interpreter

from qwen_image_fusion.kernels._triton_common import MAX_WIDTH
from qwen_image_fusion.kernels.norm_modulate import (
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
from qwen_image_fusion.kernels.quant import inverse_scale, static_quant_fp8_torch, static_quant_fp8_triton

EPS = 1e-6
STATS_SLACK = 2.0**-18  # relative budget for the fp32 LN statistics (mean scaled by mean |x|, rstd)
# (batch, tokens, width): an odd multiple of 16, the model's width, the largest block (fewer rows: the
# interpreter's cost grows with rows x width)
SHAPES = [(2, 3, 48), (2, 3, 3072), (1, 2, MAX_WIDTH)]


def zero_cond_index(batch: int, seq: int, target: int) -> torch.Tensor:
    """Edit-2511's per-token rows (`zero_cond_t`): the first `target` tokens of sample b use modulation row
    b, the reference tokens after them row B + b (the rows of t = 0); int32 [B, L]."""
    reference = (torch.arange(seq) >= target).int()
    return (torch.arange(batch, dtype=torch.int32)[:, None] + batch * reference).int()


def make_inputs(
    batch: int, seq: int, width: int, seed: int = 0, target: int | None = None
) -> dict[str, torch.Tensor]:
    """Rows with varied mean and spread; shift/scale/gate as strided chunks of one [B, 6D] tensor, or with
    `target`, of a [2B, 6D] tensor whose rows the tokens pick by `mod_index` (see `zero_cond_index`)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(batch, seq, width, generator=g)
    spread = torch.exp(torch.randn(batch, seq, 1, generator=g))
    offset = 4 * torch.randn(batch, seq, 1, generator=g)
    mod_rows = batch if target is None else 2 * batch
    mod = (0.5 * torch.randn(mod_rows, 6 * width, generator=g)).bfloat16()
    inputs = {
        "x": (rows * spread + offset).bfloat16(),
        "residual": (3 * torch.randn(batch, seq, width, generator=g)).bfloat16(),
        "gate": mod[:, :width],
        "shift": mod[:, 3 * width : 4 * width],
        "scale": mod[:, 4 * width : 5 * width],
    }
    if target is not None:
        inputs["mod_index"] = zero_cond_index(batch, seq, target)
    return inputs


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def explained_by_ln_statistics(y, ln_input, shift, scale, interpreter: bool, mod_index=None) -> torch.Tensor:
    """Mask: `y` is the contract's modulate of some `n = bf16(x_hat)` an LN could produce whose fp32
    mean and rstd differ from the exact ones by at most STATS_SLACK (sum order and fp32 rounding).

    This is how far an LN with another sum order may move: not one step of `n` in general, since
    `x - mean` cancels for values near the mean and `n(1 + scale) + shift` can cancel too. `n` and `y`
    are monotone in `x_hat`, so the range of `y` follows from the two ends of the `x_hat` interval.
    Under the interpreter (fp32 -> bf16 truncated) `n` and `y` may each be one step further out.
    """
    x = ln_input.double()
    mean = x.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt((x - mean).square().mean(-1, keepdim=True) + EPS)
    mean_err = STATS_SLACK * x.abs().mean(-1, keepdim=True)
    ends = [
        (x - mean + e) * rstd * (1 + f) for e in (-mean_err, mean_err) for f in (-STATS_SLACK, STATS_SLACK)
    ]
    x_hat = torch.stack(ends)
    widen = 1 if interpreter else 0
    n_ends = [nudge_bf16(x_hat.min(0).values.float().bfloat16(), -widen)]
    n_ends.append(nudge_bf16(x_hat.max(0).values.float().bfloat16(), widen))
    codes = torch.stack([ordered_codes(modulate_torch(n, shift, scale, mod_index))[0] for n in n_ends])
    code, nan = ordered_codes(y)
    inside = (code >= codes.min(0).values - widen) & (code <= codes.max(0).values + widen)
    return inside & ~nan


@pytest.mark.numerics
def test_twins_match_float64_within_one_rounding():
    t = make_inputs(2, 3, 3072)
    x64 = t["x"].double()
    ref = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + EPS)
    assert int(step_distance(layer_norm_torch(t["x"], EPS), ref.bfloat16()).max()) <= 1
    normed = layer_norm_torch(t["x"], EPS)
    y = modulate_torch(normed, t["shift"], t["scale"])
    assert bool(explained_by_ln_statistics(y, t["x"], t["shift"], t["scale"], interpreter=False).all())
    mod64 = normed.double() * (1 + t["scale"].double()[:, None]) + t["shift"].double()[:, None]
    assert int(step_distance(y, mod64.bfloat16()).max()) <= 1
    r64 = t["residual"].double() + t["gate"].double()[:, None] * t["x"].double()
    r = gated_residual_torch(t["residual"], t["gate"], t["x"])
    assert int(step_distance(r, r64.bfloat16()).max()) <= 1


@needs_interpreter
@pytest.mark.parametrize("per_token", [False, True], ids=["per sample", "per token"])
@pytest.mark.parametrize("shape", SHAPES)
def test_producer1_fused_equals_unfused_and_twin(shape, per_token):
    t = make_inputs(*shape, seed=shape[-1], target=1 if per_token else None)
    index = t.get("mod_index")
    args = (t["x"], t["shift"], t["scale"], EPS)
    inv = inverse_scale(torch.tensor(0.02))
    y_unfused, no_q = layer_norm_modulate_triton(*args, mod_index=index)
    q_unfused = static_quant_fp8_triton(y_unfused, inv)
    y_fused, q_fused = layer_norm_modulate_triton(*args, inv, mod_index=index)
    no_y, q_only = layer_norm_modulate_triton(*args, inv, write_y=False, mod_index=index)
    assert no_q is None and no_y is None
    assert same_bytes(y_fused, y_unfused)
    assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)
    # vs the twin: the interpreter truncates fp32 -> bf16 (one step), the LN sums run in another order
    explained = explained_by_ln_statistics(y_fused, t["x"], t["shift"], t["scale"], True, index)
    assert bool(explained.all())
    q_ref = static_quant_fp8_torch(y_fused, inv)
    assert int(step_distance(q_fused, q_ref)[interpreter_exact_range(y_fused, inv, q_ref)].max()) <= 1


@needs_interpreter
@pytest.mark.parametrize("per_token", [False, True], ids=["per sample", "per token"])
@pytest.mark.parametrize("shape", SHAPES)
def test_producer2_fused_equals_unfused_and_twin(shape, per_token):
    t = make_inputs(*shape, seed=shape[-1] + 1, target=1 if per_token else None)
    index = t.get("mod_index")
    args = (t["residual"], t["gate"], t["x"], t["shift"], t["scale"], EPS)
    inv = inverse_scale(torch.tensor(0.05))
    r_unfused, y_unfused, no_q = gated_residual_layer_norm_modulate_triton(*args, mod_index=index)
    q_unfused = static_quant_fp8_triton(y_unfused, inv)
    r_fused, y_fused, q_fused = gated_residual_layer_norm_modulate_triton(*args, inv, mod_index=index)
    r_only_q, no_y, q_only = gated_residual_layer_norm_modulate_triton(
        *args, inv, write_y=False, mod_index=index
    )
    assert no_q is None and no_y is None
    for r in (r_fused, r_only_q, gated_residual_triton(t["residual"], t["gate"], t["x"], index)):
        assert same_bytes(r, r_unfused)
    assert same_bytes(y_fused, y_unfused)
    assert same_bytes(q_fused, q_unfused) and same_bytes(q_only, q_unfused)
    r_ref = gated_residual_torch(t["residual"], t["gate"], t["x"], index)
    assert int(step_distance(r_fused, r_ref).max()) <= 1
    # the LN runs on the kernel's own r, so compare y against the twin applied to that r
    explained = explained_by_ln_statistics(y_fused, r_fused, t["shift"], t["scale"], True, index)
    assert bool(explained.all())
    q_ref = static_quant_fp8_torch(y_fused, inv)
    assert int(step_distance(q_fused, q_ref)[interpreter_exact_range(y_fused, inv, q_ref)].max()) <= 1


def exact_statistics_rows(batch: int, seq: int, width: int, seed: int) -> torch.Tensor:
    """bf16 rows whose LN statistics are the same in every sum order: `x = 2^k * (m + d)` with `m` a
    multiple of 1/4 up to 8, `d` integers up to 40 in +/- pairs (row sum 0), width a power of two. Every
    partial sum of x and of (x - mean)^2 is an fp32 number, and mean = 2^k m, var are exact."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(-40, 41, (batch, seq, width // 2), generator=g).float()
    deviations = torch.cat([half, -half], -1)
    deviations = deviations.gather(-1, torch.argsort(torch.rand(deviations.shape, generator=g), -1))
    offset = torch.randint(-32, 33, (batch, seq, 1), generator=g) / 4
    power = 2.0 ** torch.randint(-4, 5, (batch, seq, 1), generator=g)
    return ((offset + deviations) * power).bfloat16()


@needs_interpreter
@pytest.mark.parametrize("per_token", [False, True], ids=["per sample", "per token"])
def test_producers_equal_the_contract_under_interpreter_with_exact_statistics(per_token):
    """The kernels' y and r byte for byte against tests/contract.py with truncation as the bf16 rounding
    (what the interpreter does for normal values): rows whose LN sums are order-independent leave no
    other freedom, so every rounding step of the kernel is checked (a dropped `bf16(x_hat)` fails)."""
    x = exact_statistics_rows(2, 4, 1024, seed=20)
    t = make_inputs(2, 4, 1024, seed=21, target=3 if per_token else None)
    index = t.get("mod_index")
    np_index = None if index is None else index.numpy()
    bits = contract.bf16_bits
    y, _ = layer_norm_modulate_triton(x, t["shift"], t["scale"], EPS, mod_index=index)
    want = contract.layer_norm_modulate(
        bits(x), bits(t["shift"]), bits(t["scale"]), EPS, contract.truncate_bf16, np_index
    )
    contract.assert_same_encodings(y, contract.as_bf16(want), "producer 1 y")

    # producer 2: the gated residual of general rows, then the LN path on r = 0 + 1 * x = x
    args = (t["residual"], t["gate"], t["x"], t["shift"], t["scale"], EPS)
    r, _, _ = gated_residual_layer_norm_modulate_triton(*args, mod_index=index)
    r_want = contract.gated_residual(
        bits(t["residual"]), bits(t["gate"]), bits(t["x"]), contract.truncate_bf16, np_index
    )
    contract.assert_same_encodings(r, contract.as_bf16(r_want), "producer 2 r")
    zero, one = torch.zeros_like(x), torch.ones_like(t["gate"])
    r, y, _ = gated_residual_layer_norm_modulate_triton(
        zero, one, x, t["shift"], t["scale"], EPS, mod_index=index
    )
    contract.assert_same_encodings(r, x, "producer 2 r = x")
    contract.assert_same_encodings(y, contract.as_bf16(want), "producer 2 y")


@needs_interpreter
@pytest.mark.parametrize(
    "producer2", [gated_residual_layer_norm_modulate_triton, gated_residual_layer_norm_modulate_torch]
)
def test_per_token_rows_are_the_indexed_rows(producer2):
    """An index naming each token's own sample gives the per-sample bytes; Edit-2511's index changes
    exactly the reference tokens, to what a per-sample launch on the t = 0 rows gives them."""
    batch, seq, target = 2, 5, 2
    t = make_inputs(batch, seq, 64, seed=7, target=target)
    rows = (t["gate"], t["shift"], t["scale"])

    def run(mods, index=None):
        r, y, _ = producer2(t["residual"], mods[0], t["x"], *mods[1:], EPS, mod_index=index)
        return r, y

    timestep_rows = run([m[:batch] for m in rows])
    zero_rows = run([m[batch:] for m in rows])
    own = torch.arange(batch, dtype=torch.int32)[:, None].expand(batch, seq).contiguous()
    for got, want in zip(run(rows, own), timestep_rows, strict=True):
        assert same_bytes(got, want)
    for got, want, other in zip(run(rows, t["mod_index"]), timestep_rows, zero_rows, strict=True):
        assert same_bytes(got[:, :target], want[:, :target])
        assert same_bytes(got[:, target:], other[:, target:])
        assert not same_bytes(got[:, target:], want[:, target:])


@needs_interpreter
def test_constant_row_normalizes_to_zero():
    x = torch.full((1, 2, 64), 3.5).bfloat16()
    shift = torch.randn(1, 64).bfloat16()
    y, _ = layer_norm_modulate_triton(x, shift, torch.randn(1, 64).bfloat16(), EPS)
    assert same_bytes(y, shift[:, None].expand_as(y).contiguous())


def _inputs_with(**changes) -> dict[str, torch.Tensor]:
    t = make_inputs(2, 3, 64)
    t.update(changes)
    return t


def _per_token_with(**changes) -> dict[str, torch.Tensor]:
    t = make_inputs(2, 3, 64, target=1)
    t.update(changes)
    return t


@needs_interpreter
@pytest.mark.parametrize(
    "t, inv",
    [
        (_inputs_with(x=torch.randn(2, 3, 64)), None),  # fp32 activations
        (_inputs_with(shift=torch.randn(2, 64)), None),  # fp32 shift
        (_inputs_with(x=torch.randn(2, 64, 3).bfloat16().transpose(1, 2)), None),  # not contiguous
        (_inputs_with(scale=torch.randn(64, 2).bfloat16().t()), None),  # column stride != 1
        (_inputs_with(shift=torch.randn(3, 64).bfloat16()), None),  # batch mismatch
        (_inputs_with(x=torch.randn(6, 64).bfloat16()), None),  # 2-D activations
        (_inputs_with(x=torch.empty(2, 0, 64, dtype=torch.bfloat16)), None),  # no tokens
        (make_inputs(2, 3, 40), None),  # D not a multiple of 16
        (make_inputs(1, 1, MAX_WIDTH + 16), None),  # D beyond one block
        (make_inputs(2, 3, 64), torch.ones(1, dtype=torch.float16)),  # fp16 inverse scale
        (make_inputs(2, 3, 64), torch.ones(2)),  # two scales
        (make_inputs(2, 3, 64), torch.ones(1, device="meta")),  # scale on another device
    ],
)
def test_producer_guards_reject(t, inv):
    index = t.get("mod_index")
    assert layer_norm_modulate_triton(t["x"], t["shift"], t["scale"], EPS, inv, mod_index=index) is None
    args = (t["residual"], t["gate"], t["x"], t["shift"], t["scale"], EPS, inv)
    assert gated_residual_layer_norm_modulate_triton(*args, mod_index=index) is None


BAD_INDEX = [
    zero_cond_index(2, 3, 1).long(),  # int64
    zero_cond_index(2, 4, 1),  # shape is not [B, L]
    zero_cond_index(3, 2, 1).t(),  # not contiguous
    zero_cond_index(2, 3, 1).float(),  # float
    zero_cond_index(2, 3, 1).to("meta"),  # on another device
]


@needs_interpreter
@pytest.mark.parametrize("index", BAD_INDEX)
def test_per_token_guards_reject_the_index(index):
    t = _per_token_with(mod_index=index)
    test_producer_guards_reject(t, None)
    assert gated_residual_triton(t["residual"], t["gate"], t["x"], index) is None


@needs_interpreter
@pytest.mark.parametrize(
    "t",
    [
        _per_token_with(scale=make_inputs(2, 3, 64)["scale"]),  # 2 scale rows, 4 shift rows
        _inputs_with(shift=make_inputs(2, 3, 64, target=1)["shift"]),  # 4 rows, no index
    ],
)
def test_per_token_guards_reject_the_rows(t):
    test_producer_guards_reject(t, None)


@needs_interpreter
@pytest.mark.parametrize(
    "t",
    [
        _inputs_with(x=torch.randn(2, 3, 64)),  # fp32 x
        _inputs_with(residual=torch.randn(2, 64, 3).bfloat16().transpose(1, 2)),  # not contiguous
        _inputs_with(gate=torch.randn(1, 64).bfloat16()),  # batch mismatch
        make_inputs(2, 3, 40),  # D not a multiple of 16
    ],
)
def test_gated_residual_guard_rejects(t):
    assert gated_residual_triton(t["residual"], t["gate"], t["x"]) is None


def test_dispatch_on_cpu_is_the_torch_twin():
    t = make_inputs(2, 3, 3072)
    inv = inverse_scale(torch.tensor(0.02))
    got = layer_norm_modulate(t["x"], t["shift"], t["scale"], EPS, inv)
    want = layer_norm_modulate_torch(t["x"], t["shift"], t["scale"], EPS, inv)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
