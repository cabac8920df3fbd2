"""Qwen-Image 2.1's torch twins equal the numpy emulation of DESIGN §4.1 (tests/contract.py) bit for bit.

Inputs hold every bf16 encoding (NaN, inf, subnormals, both zeros) in activations, in scale and gate rows,
in the SwiGLU operands, plus rows at the model's width; modulation rows are read per token (the t = 0 row
for a prefix, the sample's row after it). Only NaN encodings are compared as "NaN" (`contract.canonical`).
The twins also give the same bits with one or two threads and in another layout.
"""

import contract
import numpy as np
import pytest
import torch
from test_kernels_contract import QUANT_SCALE, every_encoding, finite_mixed, modulation_rows
from test_kernels_norm_modulate import EPS, make_inputs
from test_kernels_quant import INPUT_SCALES, all_bf16

from qwen_image_fusion.kernels.quant import inverse_scale
from qwen_image_fusion.kernels.scale_modulate import (
    layer_norm_scale_torch,
    tanh_residual_layer_norm_scale_torch,
    tanh_rows,
)
from qwen_image_fusion.kernels.swiglu_quant import silu_mul_quant_torch, silu_mul_torch
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config

WIDTH = QwenImage21Config().inner_dim  # the released model's width
MLP = QwenImage21Config().mlp_dim


def prefix_rows(batch: int, tokens: int, prefix: int) -> torch.Tensor:
    """int32 [B, L] modulation rows as 2.1 reads them: the first `prefix` tokens the t = 0 row (index B),
    the rest their sample's row."""
    index = torch.arange(batch, dtype=torch.int32).view(batch, 1).repeat(1, tokens)
    index[:, :prefix] = batch
    return index


def scaled(x: torch.Tensor, seed: int, prefix: int) -> dict[str, torch.Tensor]:
    """Producer (a) inputs: `x` [B, L, D] with B + 1 scale rows read per token."""
    batch, tokens, width = x.shape
    return {
        "x": x,
        "scale": modulation_rows(batch + 1, width, seed),
        "index": prefix_rows(batch, tokens, prefix),
    }


PRODUCER_A_CASES = {
    "x every encoding": lambda: scaled(every_encoding((64, 8, 128)), seed=1, prefix=3),
    "x mixed magnitudes": lambda: scaled(finite_mixed(seed=2), seed=3, prefix=1),
    "scale every encoding": lambda: {
        "x": make_inputs(512, 2, 128, seed=4)["x"],
        "scale": every_encoding((512, 128), seed=5),
        # token 0 reads its sample's row, token 1 the next sample's: every row is read
        "index": torch.stack([torch.arange(512), (torch.arange(512) + 1) % 512], 1).int(),
    },
    "model width": lambda: scaled(make_inputs(2, 128, WIDTH, seed=6)["x"], seed=7, prefix=100),
}


def gated(t: dict[str, torch.Tensor], gate: torch.Tensor, residual: torch.Tensor) -> dict[str, torch.Tensor]:
    """Producer (b) inputs: a producer (a) case plus the residual and gate rows."""
    return {**t, "residual": residual, "gate": gate}


PRODUCER_B_CASES = {
    "residual and x every encoding": lambda: gated(
        scaled(every_encoding((64, 8, 128), seed=8), seed=9, prefix=5),
        modulation_rows(65, 128, 10),
        every_encoding((64, 8, 128)),
    ),
    "gate every encoding": lambda: gated(
        PRODUCER_A_CASES["scale every encoding"](),
        every_encoding((512, 128), seed=11),
        make_inputs(512, 2, 128, seed=12)["residual"],
    ),
    "model width": lambda: gated(
        scaled(make_inputs(2, 128, WIDTH, seed=13)["x"], seed=14, prefix=60),
        modulation_rows(3, WIDTH, 15),
        make_inputs(2, 128, WIDTH, seed=16)["residual"],
    ),
}


def emulated(t: dict[str, torch.Tensor], ln_input: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, q) of the contract for LN input encodings `ln_input`."""
    y = contract.layer_norm_scale(ln_input, contract.bf16_bits(t["scale"]), t["index"].numpy(), EPS)
    q = contract.quantize(y, contract.inverse_scale(QUANT_SCALE))
    return contract.as_bf16(y), contract.as_e4m3(q)


def test_tanh_rows_are_the_contract_on_every_bf16_encoding() -> None:
    gate = all_bf16().reshape(512, 128)
    got = tanh_rows(gate)
    want = torch.from_numpy(contract.tanh_rows(contract.bf16_bits(gate)))
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))


@pytest.mark.parametrize("case", list(PRODUCER_A_CASES))
def test_layer_norm_scale_twin_is_the_contract(case: str) -> None:
    t = PRODUCER_A_CASES[case]()
    inv = inverse_scale(torch.tensor(QUANT_SCALE))
    y, q = layer_norm_scale_torch(t["x"], t["scale"], t["index"], EPS, inv)
    y_want, q_want = emulated(t, contract.bf16_bits(t["x"]))
    contract.assert_same_encodings(y, y_want, f"{case}: y")
    contract.assert_same_encodings(q, q_want, f"{case}: q")


@pytest.mark.parametrize("case", list(PRODUCER_B_CASES))
def test_tanh_residual_layer_norm_scale_twin_is_the_contract(case: str) -> None:
    t = PRODUCER_B_CASES[case]()
    inv = inverse_scale(torch.tensor(QUANT_SCALE))
    args = (t["residual"], tanh_rows(t["gate"]), t["x"], t["scale"], t["index"], EPS, inv)
    r, y, q = tanh_residual_layer_norm_scale_torch(*args)
    bits = contract.bf16_bits
    tanh_gate = contract.tanh_rows(bits(t["gate"]))
    r_want = contract.tanh_gated_residual(bits(t["residual"]), tanh_gate, t["index"].numpy(), bits(t["x"]))
    y_want, q_want = emulated(t, r_want)
    contract.assert_same_encodings(r, contract.as_bf16(r_want), f"{case}: r")
    contract.assert_same_encodings(y, y_want, f"{case}: y")
    contract.assert_same_encodings(q, q_want, f"{case}: q")


def swiglu_operands(seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, g, p): each operand once as every bf16 encoding against normal data of the MLP's scale."""
    g = torch.Generator().manual_seed(seed)
    normal = (3 * torch.randn(1 << 16, generator=g)).bfloat16()
    every = all_bf16()
    return [("g every encoding", every, normal), ("p every encoding", normal, every)]


def test_silu_mul_twin_is_the_contract() -> None:
    for name, g, p in swiglu_operands(seed=17):
        g, p = g.reshape(4, 128, 128), p.reshape(4, 128, 128)
        y_want = contract.silu_mul(contract.bf16_bits(g), contract.bf16_bits(p))
        contract.assert_same_encodings(silu_mul_torch(g, p), contract.as_bf16(y_want), f"{name}: y")
        for s in INPUT_SCALES:
            q_want = contract.as_e4m3(contract.quantize(y_want, contract.inverse_scale(s)))
            q = silu_mul_quant_torch(g, p, inverse_scale(torch.tensor(s)))
            contract.assert_same_encodings(q, q_want, f"{name}, scale {s}: q")


def test_silu_mul_twin_at_the_mlp_width() -> None:
    t = make_inputs(2, 4, MLP, seed=18)
    g, p = t["x"], t["residual"]
    y_want = contract.silu_mul(contract.bf16_bits(g), contract.bf16_bits(p))
    contract.assert_same_encodings(silu_mul_torch(g, p), contract.as_bf16(y_want), "y")


def _run_all_twins(threads: int, perm: torch.Tensor) -> list[torch.Tensor]:
    """Every 2.1 twin's outputs on model-width inputs, with `threads` threads, tokens permuted by `perm`
    (outputs permuted back)."""
    t = PRODUCER_B_CASES["model width"]()
    inv = inverse_scale(torch.tensor(QUANT_SCALE))
    x, residual, index = t["x"][:, perm], t["residual"][:, perm], t["index"][:, perm].contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        r, y, q = tanh_residual_layer_norm_scale_torch(
            residual, tanh_rows(t["gate"]), x, t["scale"], index, EPS, inv
        )
        h = silu_mul_torch(x, residual)
    finally:
        torch.set_num_threads(before)
    back = torch.argsort(perm)
    return [v[:, back].view(torch.uint8) for v in (r, y, q, h)]


def test_twins_do_not_depend_on_threads_or_layout() -> None:
    tokens = PRODUCER_B_CASES["model width"]()["x"].shape[1]
    identity = torch.arange(tokens)
    shuffled = torch.randperm(tokens, generator=torch.Generator().manual_seed(19))
    base = _run_all_twins(1, identity)
    for threads, perm in ((2, identity), (1, shuffled), (2, shuffled)):
        for got, want in zip(_run_all_twins(threads, perm), base, strict=True):
            assert torch.equal(got, want), f"threads={threads}"
