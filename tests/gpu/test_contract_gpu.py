"""DESIGN §4's rounding on the GPU, op by op (issue 28): what the H200 run must show.

- The torch twins on CUDA give the CPU twins' bytes (NaN as one code) on every bf16 encoding and at the
  model's width: their arithmetic (kernels/fp32.py) is machine-independent, so the CUDA fallback path
  (an input a Triton guard rejects) computes the contract too.
- The compiled Triton producers and the q/k RMSNorm + RoPE kernel equal the numpy emulation of the
  contract (tests/contract.py, nearest-even) byte for byte on rows whose sums are exact in every order,
  at 4096 rows: with the sum order out of play, any approximate division or sqrt, FMA or conversion in
  the kernels would show (their PTX is also checked on CPU, tests/test_kernels_launch.py).
- The compiled GELU kernel on all 65536 bf16 inputs is the contract's chain for a tanh within 2 fp32 ulps
  of the correctly rounded one (libdevice `tanhf`'s documented bound); how many g differ from the twin is
  printed (run with -s).
"""

import contract
import pytest
import torch
from test_kernels_contract import PRODUCER1_CASES, PRODUCER2_CASES, QUANT_SCALE, every_encoding
from test_kernels_norm_modulate import EPS, exact_statistics_rows, make_inputs
from test_kernels_quant import all_bf16
from test_qk_norm_rope import make_inputs as qk_inputs

from qwen_image_fusion.kernels.gelu_quant import (
    GELU_CUBIC,
    SQRT_2_OVER_PI,
    gelu_tanh_quant_triton,
    gelu_tanh_torch,
    tanh_fp32,
)
from qwen_image_fusion.kernels.norm_modulate import (
    gated_residual_layer_norm_modulate_torch,
    gated_residual_layer_norm_modulate_triton,
    layer_norm_modulate_torch,
    layer_norm_modulate_triton,
)
from qwen_image_fusion.kernels.qk_norm_rope import rms_norm_rope_torch, rms_norm_rope_triton
from qwen_image_fusion.kernels.quant import inverse_scale

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
TANHF_ULPS = 2  # CUDA's documented maximum error of tanhf


def on_cuda(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(CUDA) for k, v in t.items()}


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    contract.assert_same_encodings(got.cpu(), want.cpu(), what)


@pytest.mark.parametrize("case", list(PRODUCER1_CASES))
def test_producer1_twin_on_cuda_is_the_cpu_twin(case):
    t = PRODUCER1_CASES[case]()
    inv = inverse_scale(torch.tensor(QUANT_SCALE))
    y, q = layer_norm_modulate_torch(t["x"], t["shift"], t["scale"], EPS, inv, mod_index=t.get("mod_index"))
    c = on_cuda(t)
    y_cuda, q_cuda = layer_norm_modulate_torch(
        c["x"], c["shift"], c["scale"], EPS, inv.to(CUDA), mod_index=c.get("mod_index")
    )
    same(y_cuda, y, f"{case}: y")
    same(q_cuda, q, f"{case}: q")


@pytest.mark.parametrize("case", list(PRODUCER2_CASES))
def test_producer2_twin_on_cuda_is_the_cpu_twin(case):
    t = PRODUCER2_CASES[case]()
    inv = inverse_scale(torch.tensor(QUANT_SCALE))
    names = ("residual", "gate", "x", "shift", "scale")
    cpu = gated_residual_layer_norm_modulate_torch(
        *(t[n] for n in names), EPS, inv, mod_index=t.get("mod_index")
    )
    c = on_cuda(t)
    gpu = gated_residual_layer_norm_modulate_torch(
        *(c[n] for n in names), EPS, inv.to(CUDA), mod_index=c.get("mod_index")
    )
    for name, got, want in zip("ryq", gpu, cpu, strict=True):
        same(got, want, f"{case}: {name}")


def test_gelu_and_qk_twins_on_cuda_are_the_cpu_twins():
    """GELU: the chain on CUDA (float64 tanh there) against the CPU twin's table, every encoding; q/k
    norm + RoPE: every encoding as x, with rows of every encoding class as weights."""
    h = every_encoding((2, 256, 128))
    same(gelu_tanh_torch(h.to(CUDA)), gelu_tanh_torch(h), "gelu")
    x = all_bf16().view(2, 16, 16, 128)
    rope = qk_inputs(2, 16, 16, 128, seed=2)["rope"]
    for weight in x.view(-1, 128)[[0, 255, 256, 383, 500, 511]]:
        want = rms_norm_rope_torch(x, weight, rope, EPS)
        same(rms_norm_rope_torch(x.to(CUDA), weight.to(CUDA), rope.to(CUDA), EPS), want, "q/k norm + rope")


@pytest.mark.parametrize("width", [1024, 2048, 4096])
def test_compiled_producers_are_the_contract_with_exact_statistics(width):
    """4096 rows per width (2 x 2048) whose LN sums are exact in any order: y, q (producer 1) and r, y, q
    (producer 2) byte for byte the numpy emulation with nearest-even narrowing."""
    bits = contract.bf16_bits
    x = exact_statistics_rows(2, 2048, width, seed=width)
    t = make_inputs(2, 2048, width, seed=width + 1)
    inv = inverse_scale(torch.tensor(QUANT_SCALE)).to(CUDA)
    inv_np = contract.inverse_scale(QUANT_SCALE)
    want_y = contract.layer_norm_modulate(bits(x), bits(t["shift"]), bits(t["scale"]), EPS)
    want_q = contract.as_e4m3(contract.quantize(want_y, inv_np))
    c = on_cuda(t)
    y, q = layer_norm_modulate_triton(x.to(CUDA), c["shift"], c["scale"], EPS, inv)
    same(y, contract.as_bf16(want_y), f"producer 1 y, D={width}")
    same(q, want_q, f"producer 1 q, D={width}")

    # producer 2: its gated residual on general rows (no reduction), and its LN path on r = 0 + 1 * x
    r, _, _ = gated_residual_layer_norm_modulate_triton(
        c["residual"], c["gate"], c["x"], c["shift"], c["scale"], EPS
    )
    want_r = contract.gated_residual(bits(t["residual"]), bits(t["gate"]), bits(t["x"]))
    same(r, contract.as_bf16(want_r), f"producer 2 r, D={width}")
    zero, one = torch.zeros_like(x, device=CUDA), torch.ones_like(t["gate"], device=CUDA)
    args = (zero, one, x.to(CUDA), c["shift"], c["scale"], EPS, inv)
    r, y, q = gated_residual_layer_norm_modulate_triton(*args)
    same(r, x, "producer 2 r = x")
    same(y, contract.as_bf16(want_y), f"producer 2 y, D={width}")
    same(q, want_q, f"producer 2 q, D={width}")


@pytest.mark.parametrize("heads, dim", [(24, 128), (4, 32)])
def test_compiled_qk_norm_rope_is_the_contract_with_exact_sums(heads, dim):
    """x = k * 2^e per row (every partial sum of squares exact in fp32): the compiled kernel's bytes are
    the numpy emulation's, at 2 x 4096 tokens of the model's heads (and the embedded model's)."""
    t = qk_inputs(2, 4096, heads, dim, seed=dim, exact_sums=True)
    want = contract.rms_norm_rope(
        contract.bf16_bits(t["x"]), contract.bf16_bits(t["weight"]), t["rope"].numpy(), EPS
    )
    got = rms_norm_rope_triton(t["x"].to(CUDA), t["weight"].to(CUDA), t["rope"].to(CUDA), EPS)
    same(got, contract.as_bf16(want), f"q/k norm + rope {heads}x{dim}")


def test_compiled_gelu_is_within_tanhf_error_on_every_bf16_input():
    """For each of the 65536 bf16 inputs, the kernel's g equals the contract's chain evaluated at some t
    within TANHF_ULPS fp32 ulps of the correctly rounded tanh (NaN where the chain gives NaN)."""
    h = all_bf16()
    inv = inverse_scale(torch.tensor(0.03125)).to(CUDA)
    g, _ = gelu_tanh_quant_triton(h.to(CUDA), inv, write_g=True)
    g = g.cpu()
    x = h.float()
    t = tanh_fp32(SQRT_2_OVER_PI * (x + GELU_CUBIC * (x * x * x)))
    candidates, below, above = [t], t, t
    for _ in range(TANHF_ULPS):
        below, above = torch.nextafter(below, torch.tensor(-2.0)), torch.nextafter(above, torch.tensor(2.0))
        candidates += [below.clamp(min=-1.0), above.clamp(max=1.0)]  # tanhf never leaves [-1, 1]
    allowed = torch.stack([(0.5 * x * (1.0 + c)).bfloat16() for c in candidates])
    nan = allowed.isnan().any(0)
    match = (allowed.view(torch.int16) == g.view(torch.int16)).any(0)
    assert bool(torch.where(nan, g.isnan(), match).all())
    twin = gelu_tanh_torch(h)
    differ = (~(twin.view(torch.int16) == g.view(torch.int16)) & ~(twin.isnan() & g.isnan())).sum()
    print(f"gelu: {int(differ)} of 65536 bf16 inputs give another g than the correctly rounded twin")
