"""NVFP4's format and arithmetic (issue 52, DESIGN §19) on the CPU: module exclusion rules against trying
every rule, the global encode scale without a host read (cpu, and cuda where present), E2M1 codes and their
nibble order, the quantizer, and the weight path's Triton GEMM (interpreter) against its torch twin."""

import fnmatch
import math

import numpy as np
import pytest
import torch
from contract import truncate_bf16
from helpers import NoHostSync
from steps import step_distance

from qwen_image_fusion.kernels.nvfp4 import (
    E2M1_VALUES,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    global_encode_scale,
    nvfp4_linear,
    nvfp4_linear_fp32,
    nvfp4_linear_triton,
    pack_e2m1,
    quantize_nvfp4,
    unpack_e2m1,
)
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.nvfp4 import quantize_nvfp4_weight
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.model import OUTSIDE_BLOCKS, QUANTIZATION
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer

FP32 = np.finfo(np.float32)
AMAX = {
    "zero": 0.0,
    "3.5": 3.5,
    "tiny": float(FP32.tiny),
    "max": float(FP32.max),
    "inf": math.inf,
    "-inf": -math.inf,
    "nan": math.nan,
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# Module exclusion: literal rules a set walked up the dotted ancestors, globs fnmatch'ed as before.


def ancestors(name: str) -> list[str]:
    """`name` and each dotted ancestor: a.b.c, a.b, a."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def matched_by_every_rule(name: str, rules: tuple[str, ...]) -> bool:
    """The rule as written out: a glob matches the name (fnmatch, as before); a literal name matches that
    module and everything inside it. Every rule tried against every name (and ancestor)."""
    for rule in rules:
        literal = not set("*?[") & set(rule)
        for candidate in ancestors(name) if literal else [name]:
            if fnmatch.fnmatchcase(candidate, rule):
                return True
    return False


@pytest.fixture(scope="module")
def full_size_names() -> list[str]:
    """Every module name of the full-size Qwen-Image transformer (60 blocks; built on the meta device)."""
    with torch.device("meta"):
        model = QwenImageTransformer(QwenImageConfig())
    return [name for name, _ in model.named_modules() if name]


def literal_export(names: list[str]) -> tuple[str, ...]:
    """An exclusion list as ModelOpt exports write it: each excluded module by its full name (hundreds): here
    those of the first and last two blocks, every block's modulation and everything outside the blocks."""
    edges = (
        "transformer_blocks.0.",
        "transformer_blocks.1.",
        "transformer_blocks.58.",
        "transformer_blocks.59.",
    )
    return tuple(
        n
        for n in names
        if n.startswith(edges)
        or n.endswith(("img_mod.1", "txt_mod.1"))
        or not n.startswith("transformer_blocks")
    )


def test_exclusion_rules_give_the_answers_of_trying_every_rule(full_size_names):
    names = [*full_size_names, "transformer_blocks.300.attn.to_q", "transformer_blocks", "proj_out.extra"]
    export = literal_export(full_size_names)
    assert len(export) > 200
    rule_sets = {
        "fp8 fallback": QUANTIZATION.bf16_fallback,
        "nvfp4 default": (*OUTSIDE_BLOCKS, "transformer_blocks.0.*", "transformer_blocks.59.*"),
        "literal export": export,
        "containers and globs": ("transformer_blocks.3", "transformer_blocks.4?.attn", "*.txt_mlp.net.[02]*"),
    }
    for what, rules in rule_sets.items():
        config = QuantConfig("NVFP4", rules)
        got = [n for n in names if config.ignores(n)]
        assert got == [n for n in names if matched_by_every_rule(n, rules)], what
        # where no literal rule names an ancestor, as before: every rule fnmatch'ed against the name alone
        plain = [n for n in names if not set(rules) & set(ancestors(n)[1:])]
        before = [n for n in plain if any(fnmatch.fnmatchcase(n, r) for r in rules)]
        assert [n for n in plain if config.ignores(n)] == before, what


def test_a_literal_rule_covers_what_is_inside_its_module_only():
    config = QuantConfig("NVFP4", ("transformer_blocks.3", "norm_out.linear"))
    assert config.ignores("transformer_blocks.3.attn.to_q")
    assert config.ignores("transformer_blocks.3")
    assert not config.ignores("transformer_blocks.30.attn.to_q")  # a dotted ancestor, not a string prefix
    assert not config.ignores("transformer_blocks")
    assert not config.ignores("norm_out")


# The global encode scale: no host read, exact IEEE arithmetic.


def expected_scale(amax: float, e4m3_max: float) -> np.float32:
    """e4m3_max * 6 / amax rounded once to fp32 (a float64 quotient of fp32 numbers rounds to fp32 as the
    fp32 quotient does), float32's max where that overflows, 1 where it is 0, NaN kept."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        q = np.float32(np.float64(e4m3_max * 6) / np.float64(np.float32(amax)))
    if np.isinf(q) and q > 0:
        return FP32.max
    return np.float32(1.0) if q == 0 else q


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("e4m3_max", [448.0, 256.0])
@pytest.mark.parametrize("shape", [(), (1,), (8,), (2, 4)], ids=str)
@pytest.mark.parametrize("amax", AMAX.values(), ids=AMAX.keys())
def test_global_encode_scale_reads_nothing_back_and_is_exact(device, e4m3_max, shape, amax):
    values = torch.full(shape, amax, dtype=torch.float32, device=device)
    with NoHostSync(torch.device(device)):
        scale = global_encode_scale(values, e4m3_max)
    want = torch.full(shape, float(expected_scale(amax, e4m3_max)), dtype=torch.float32, device=device)
    assert scale.dtype == torch.float32 and scale.shape == values.shape
    torch.testing.assert_close(scale, want, rtol=0, atol=0, equal_nan=True)


def test_global_encode_scale_of_mixed_values():
    values = torch.tensor([3.0, 1e-3, 448.0, 7.5e-39, 1e30, 2688.0], dtype=torch.float32)
    want = [expected_scale(float(v), 448.0) for v in values.numpy()]
    assert global_encode_scale(values).numpy().tolist() == want
    assert want[-1] == 1.0 and want[2] == 6.0


# E2M1 codes, their nibble order, and the exact products with E4M3 scales.


def test_e2m1_rounds_to_nearest_even_and_saturates_as_modelopt():
    values = [0.25, 0.2501, 0.75, 1.25, 1.2501, 1.75, 2.5, 2.5001, 3.5, 5.0, 5.0001, 1e9, math.inf, 0.7499]
    want = [0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, 6.0, 0.5]
    v = torch.tensor(values + [-x for x in values])
    codes = e2m1_encode(v)
    assert e2m1_decode(codes).float().tolist() == want + [-x for x in want]
    assert e2m1_encode(torch.tensor([-0.1, -0.0, math.nan])).tolist() == [8, 0, 0]  # sign from v < 0


def test_codes_decode_to_the_e2m1_values_and_pack_low_nibble_first():
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_decode(codes).float().tolist() == [*E2M1_VALUES, *(-v for v in E2M1_VALUES)]
    assert pack_e2m1(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    random = torch.randint(0, 16, (5, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_e2m1(pack_e2m1(random)), random)


def test_every_e2m1_times_every_e4m3_scale_is_exact_in_bf16():
    scale_bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scale_bits = scale_bits[(scale_bits & 0x7F) != 0x7F]  # NaN is no scale
    scales = scale_bits.view(torch.float8_e4m3fn)[:, None].expand(-1, 16)  # [254, 16]: one block per scale
    codes = torch.arange(16, dtype=torch.uint8).expand(scales.shape[0], 16)
    got = dequantize_nvfp4(pack_e2m1(codes.contiguous()), scales[:, :1].contiguous())
    exact = e2m1_decode(codes).double() * scales.double()
    assert got.dtype == torch.bfloat16 and torch.equal(got.double(), exact)


# The quantizer (weights in `quantize`, and the activations' contract).


def test_quantizer_keeps_each_block_within_half_an_e2m1_step_and_maps_its_amax_to_6():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 96, generator=gen) * torch.logspace(-2, 1, 64)[:, None]
    with NoHostSync():
        packed, block_scale, weight_scale_2 = quantize_nvfp4_weight(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 48)
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (64, 6)
    assert weight_scale_2.dtype == torch.float32 and weight_scale_2.shape == ()
    unit = block_scale.float() * weight_scale_2  # one E2M1 unit of each block, [64, 6]
    assert bool((unit >= 2.0**-6 * weight_scale_2).all())  # normal E4M3 scales only, below
    codes = unpack_e2m1(packed).unflatten(-1, (6, 16))
    assert bool(((codes & 7).amax(dim=-1) == 7).all())  # each block's largest |value| becomes 6
    error = (dequantize_nvfp4(packed, block_scale).float() * weight_scale_2 - weight).abs()
    assert bool(
        (error.unflatten(-1, (6, 16)) <= unit[..., None] * (1 + 2.0**-20)).all()
    )  # gap 4|6 is 2 units


def test_quantizer_of_an_all_zero_weight_has_a_positive_global_scale():
    packed, block_scale, weight_scale_2 = quantize_nvfp4_weight(torch.zeros(4, 32))
    assert not packed.any() and not block_scale.float().any()
    assert 0 < float(weight_scale_2) < 1e-38


def test_a_block_whose_scale_rounds_to_zero_is_all_zero_codes():
    weight = torch.full((1, 32), 1e-30)
    weight[0, 16:] = 1.0  # the global scale follows this block; the first one's scale underflows E4M3
    packed, block_scale, _ = quantize_nvfp4_weight(weight)
    assert block_scale.float().tolist() == [[0.0, 448.0]]
    assert unpack_e2m1(packed)[0, :16].tolist() == [0] * 16


def test_quantizer_takes_the_encode_scale_as_a_tensor_on_its_device():
    values = torch.tensor([[1.0, -2.0, 0.5, 6.0] * 4])
    packed, block_scale = quantize_nvfp4(values, torch.tensor([1.0]))
    assert block_scale.float().tolist() == [[1.0]]
    assert e2m1_decode(unpack_e2m1(packed)).float().tolist() == values.tolist()


# The weight path: the Triton GEMM (interpreter) against its torch twin.


def exact_sum_operands(rows: int, n: int, k: int, seed: int, bias: bool):
    """Operands whose fp32 sums are exact in any order: small integer activations, block scales and the
    global scale powers of two; every product is a multiple of 2^-4 and their magnitudes sum far below 2^24
    of those units, so twin and kernel must agree byte for byte."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (rows, k), generator=gen).bfloat16()
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    block_scale = (2.0 ** torch.randint(-3, 4, (n, k // 16), generator=gen)).to(torch.float8_e4m3fn)
    b = torch.randint(-4, 5, (n,), generator=gen).bfloat16() if bias else None
    return x, packed, block_scale, torch.tensor([0.25]), b


def interpreter_bf16(v: torch.Tensor) -> torch.Tensor:
    """bf16 of fp32 `v` as Triton's interpreter writes it (truncation, DESIGN §4)."""
    return torch.from_numpy(truncate_bf16(v.numpy()).view(np.int16)).view(torch.bfloat16)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_weight_path_kernel_is_its_twin_byte_for_byte_where_sums_are_exact(rows, bias):
    args = exact_sum_operands(rows, 96, 160, seed=rows, bias=bias)
    x, packed, block_scale, _, b = args
    exact = (x.double() @ dequantize_nvfp4(packed, block_scale).double().t()) * 0.25
    exact = exact if b is None else exact + b.double()
    twin = nvfp4_linear_fp32(*args)
    assert torch.equal(twin, exact.float())  # the premise: every sum exact
    got = nvfp4_linear_triton(*args)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert torch.equal(got.view(torch.int16), interpreter_bf16(twin).view(torch.int16))
    assert torch.equal(nvfp4_linear(*args), twin.bfloat16())  # on CPU tensors the op is its twin


@pytest.mark.interpreter
def test_weight_path_kernel_within_one_bf16_step_of_its_twin_on_random_data():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 256, generator=gen).bfloat16()
    packed, block_scale, scale_2 = quantize_nvfp4_weight(torch.randn(80, 256, generator=gen))
    b = torch.randn(80, generator=gen).bfloat16()
    got = nvfp4_linear_triton(x, packed, block_scale, scale_2.reshape(1), b)
    twin = interpreter_bf16(nvfp4_linear_fp32(x, packed, block_scale, scale_2, b))
    assert int(step_distance(got, twin).max()) <= 1  # the fp32 sums in two orders, then truncation


def guard_cases():
    x, packed, block_scale, scale_2, b = exact_sum_operands(4, 32, 64, seed=0, bias=True)
    return {
        "fp32 activations": (x.float(), packed, block_scale, scale_2, b),
        "not contiguous": (torch.cat([x, x], 1)[:, ::2], packed, block_scale, scale_2, b),
        "3-D activations": (x[None], packed, block_scale, scale_2, b),
        "no rows": (x[:0], packed, block_scale, scale_2, b),
        "K not a multiple of 16": (
            x[:, :56].contiguous(),
            packed[:, :28].contiguous(),
            block_scale,
            scale_2,
            b,
        ),
        "packed of another K": (x, packed[:, :16].contiguous(), block_scale, scale_2, b),
        "fp32 block scales": (x, packed, block_scale.float(), scale_2, b),
        "two global scales": (x, packed, block_scale, torch.ones(2), b),
        "fp32 bias": (x, packed, block_scale, scale_2, b.float()),
    }


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(guard_cases()))
def test_weight_path_guard_rejects(case):
    assert nvfp4_linear_triton(*guard_cases()[case]) is None
