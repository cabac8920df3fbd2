"""The torch twins equal the step-by-step numpy emulation of DESIGN §4 (tests/contract.py) bit for bit.

Inputs hold every bf16 encoding (NaN, inf, subnormals, both zeros) in activations, in shift / scale /
gate rows and in the GELU input, plus rows at the model's width with real cancellation; the modulation
rows are per sample or picked per token by `mod_index` (every row of every encoding reached, and Edit-2511's
layout). Only NaN encodings are compared as "NaN" (`contract.canonical`); every other byte must match.
"""

import contract
import numpy as np
import pytest
import torch
from test_kernels_gelu import gelu_inputs
from test_kernels_norm_modulate import EPS, make_inputs
from test_kernels_quant import INPUT_SCALES, all_bf16

from qwen_image_fusion.kernels.gelu_quant import gelu_tanh_quant_torch, gelu_tanh_torch
from qwen_image_fusion.kernels.norm_modulate import (
    gated_residual_layer_norm_modulate_torch,
    layer_norm_modulate_torch,
)
from qwen_image_fusion.kernels.quant import inverse_scale, static_quant_fp8_torch

pytestmark = pytest.mark.numerics
QUANT_SCALE = 0.02


def every_encoding(shape: tuple[int, ...], seed: int | None = None) -> torch.Tensor:
    """All 65536 bf16 encodings in order (each row of 128 is one sign and exponent, every mantissa), or
    shuffled with `seed`, reshaped to `shape`."""
    values = all_bf16()
    if seed is not None:
        values = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(seed))]
    return values.reshape(shape)


def finite_mixed(seed: int) -> torch.Tensor:
    """The 65280 finite bf16 encodings shuffled into [255, 2, 128]: every magnitude in one row, so many
    rows have LN sums that overflow fp32."""
    values = all_bf16()
    values = values[values.isfinite()]
    order = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(seed))
    return values[order].reshape(255, 2, 128)


def every_row_twice(batch: int, seq: int, rows: int, seed: int) -> torch.Tensor:
    """int32 [B, L] per-token index over `rows` modulation rows, each row used by two tokens (B*L = 2R)."""
    order = torch.randperm(batch * seq, generator=torch.Generator().manual_seed(seed)) % rows
    return order.reshape(batch, seq).int()


def modulation_rows(batch: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(batch, width, generator=g)).bfloat16()


def modulated(x: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Producer 1 inputs: `x` with shift and scale rows like the model's."""
    batch, width = x.shape[0], x.shape[-1]
    return {
        "x": x,
        "shift": modulation_rows(batch, width, seed),
        "scale": modulation_rows(batch, width, seed + 1),
    }


def model_width(seed: int) -> dict[str, torch.Tensor]:
    """512 rows at the model's width: real cancellation in `x - mean` and in the modulation."""
    return make_inputs(2, 256, 3072, seed=seed)


def cancelling_shift(seed: int) -> dict[str, torch.Tensor]:
    """One row per sample, `shift = -n` where n = bf16(x_hat), and tiny scales: then y is about n * scale
    and the fp32 rounding of the product n * (1 + scale) is a visible fraction of y's bf16 step, so a
    product that is not rounded on its own (an FMA) changes many values."""
    t = modulated(make_inputs(512, 1, 128, seed=seed)["x"], seed)
    zero = contract.bf16_bits(torch.zeros_like(t["shift"]))
    normed = contract.layer_norm_modulate(contract.bf16_bits(t["x"]), zero, zero, EPS)
    t["shift"] = -contract.as_bf16(normed)[:, 0]
    t["scale"] = (t["scale"].float() * 2.0**-13).bfloat16()
    return t


PRODUCER1_CASES = {
    "x every encoding": lambda: modulated(every_encoding((64, 8, 128)), seed=1),
    "x mixed magnitudes": lambda: modulated(finite_mixed(seed=3), seed=4),
    "shift and scale every encoding": lambda: {
        "x": make_inputs(512, 2, 128, seed=6)["x"],
        "shift": every_encoding((512, 128), seed=7),
        "scale": every_encoding((512, 128), seed=8),
    },
    "model width": lambda: model_width(seed=9),
    "shift cancels n": lambda: cancelling_shift(seed=10),
    "per token: shift and scale rows every encoding": lambda: {
        "x": make_inputs(128, 8, 128, seed=30)["x"],
        "shift": every_encoding((512, 128), seed=31),
        "scale": every_encoding((512, 128), seed=32),
        "mod_index": every_row_twice(128, 8, 512, seed=33),
    },
    "per token: model width, Edit-2511 layout": lambda: make_inputs(2, 256, 3072, seed=34, target=100),
}
PRODUCER2_CASES = {
    "residual and x every encoding": lambda: {
        **modulated(every_encoding((64, 8, 128), seed=11), seed=12),
        "residual": every_encoding((64, 8, 128)),
        "gate": modulation_rows(64, 128, 14),
    },
    "gate every encoding": lambda: {
        **make_inputs(512, 2, 128, seed=15),
        "gate": every_encoding((512, 128), seed=16),
    },
    "model width": lambda: model_width(seed=17),
    "per token: gate rows every encoding": lambda: {
        **modulated(make_inputs(128, 8, 128, seed=35)["x"], seed=39),
        "residual": make_inputs(128, 8, 128, seed=40)["residual"],
        "shift": modulation_rows(512, 128, seed=41),
        "scale": modulation_rows(512, 128, seed=42),
        "gate": every_encoding((512, 128), seed=36),
        "mod_index": every_row_twice(128, 8, 512, seed=37),
    },
    "per token: model width, Edit-2511 layout": lambda: make_inputs(2, 256, 3072, seed=38, target=57),
}


def index_of(t: dict[str, torch.Tensor]) -> np.ndarray | None:
    """The case's per-token index as numpy for the emulation (None: per-sample rows)."""
    return None if "mod_index" not in t else t["mod_index"].numpy()


def emulated_producer(t: dict[str, torch.Tensor], ln_input: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, q) of the contract for LN input encodings `ln_input` and the case's shift and scale."""
    bits = contract.bf16_bits
    y = contract.layer_norm_modulate(ln_input, bits(t["shift"]), bits(t["scale"]), EPS, mod_index=index_of(t))
    q = contract.quantize(y, contract.inverse_scale(QUANT_SCALE))
    return contract.as_bf16(y), contract.as_e4m3(q)


@pytest.mark.parametrize("case", list(PRODUCER1_CASES))
def test_layer_norm_modulate_twin_is_the_contract(case: str) -> None:
    t = PRODUCER1_CASES[case]()
    inv = inverse_scale(torch.tensor(QUANT_SCALE))
    y, q = layer_norm_modulate_torch(t["x"], t["shift"], t["scale"], EPS, inv, mod_index=t.get("mod_index"))
    y_want, q_want = emulated_producer(t, contract.bf16_bits(t["x"]))
    contract.assert_same_encodings(y, y_want, f"{case}: y")
    contract.assert_same_encodings(q, q_want, f"{case}: q")


@pytest.mark.parametrize("case", list(PRODUCER2_CASES))
def test_gated_residual_layer_norm_modulate_twin_is_the_contract(case: str) -> None:
    t = PRODUCER2_CASES[case]()
    inv = inverse_scale(torch.tensor(QUANT_SCALE))
    args = (t["residual"], t["gate"], t["x"], t["shift"], t["scale"], EPS, inv)
    r, y, q = gated_residual_layer_norm_modulate_torch(*args, mod_index=t.get("mod_index"))
    bits = contract.bf16_bits
    r_want = contract.gated_residual(
        bits(t["residual"]), bits(t["gate"]), bits(t["x"]), mod_index=index_of(t)
    )
    y_want, q_want = emulated_producer(t, r_want)
    contract.assert_same_encodings(r, contract.as_bf16(r_want), f"{case}: r")
    contract.assert_same_encodings(y, y_want, f"{case}: y")
    contract.assert_same_encodings(q, q_want, f"{case}: q")


def test_gelu_twin_is_the_contract() -> None:
    h = gelu_inputs()
    g_want = contract.gelu_tanh(contract.bf16_bits(h))
    contract.assert_same_encodings(gelu_tanh_torch(h), contract.as_bf16(g_want), "g")
    for s in INPUT_SCALES:
        q_want = contract.as_e4m3(contract.quantize(g_want, contract.inverse_scale(s)))
        contract.assert_same_encodings(
            gelu_tanh_quant_torch(h, inverse_scale(torch.tensor(s))), q_want, f"scale {s}: q"
        )


def test_quantizer_twin_is_the_contract_on_all_bf16() -> None:
    """Every byte, NaN signs included: the quantizer's input is bf16 as given, not a torch conversion."""
    y = all_bf16()
    for s in INPUT_SCALES:
        got = static_quant_fp8_torch(y, inverse_scale(torch.tensor(s))).view(torch.uint8)
        want = torch.from_numpy(contract.quantize(contract.bf16_bits(y), contract.inverse_scale(s)))
        assert torch.equal(got, want), f"scale {s}: {int((got != want).sum())} bytes differ"
