"""NVFP4 W4A4 for Blackwell (issue 52), everything that runs without an FP4 tensor core: the activation
quantizer's Triton kernel against its twin on every bf16 value (interpreter), the swizzled block-scale layout
`torch._scaled_mm` reads, the LayerNorm + modulate + NVFP4 producers (fused equals unfused, their codes the
quantizer's of their own y), the W4A4 GEMM's arithmetic through its exact twin, the gate that runs W4A4 only
on capability 10 or later (and on the CPU, through the twins), and a whole NVFP4 checkpoint on the CPU."""

import numpy as np
import pytest
import torch
from helpers import png_sha256, step_without_host_sync
from test_kernels_norm_modulate import EPS, make_inputs, same_bytes
from test_kernels_quant import all_bf16, needs_interpreter
from test_nvfp4_checkpoint import nvfp4_dir  # noqa: F401 (the module fixture: the embedded default in NVFP4)

from qwen_image_fusion.kernels.norm_modulate import (
    gated_residual_layer_norm_modulate_triton,
    layer_norm_modulate_triton,
)
from qwen_image_fusion.kernels.nvfp4 import dequantize_nvfp4, pack_e2m1, quantize_nvfp4
from qwen_image_fusion.kernels.nvfp4_producers import (
    gated_residual_layer_norm_modulate_nvfp4_torch,
    gated_residual_layer_norm_modulate_nvfp4_triton,
    layer_norm_modulate_nvfp4_torch,
    layer_norm_modulate_nvfp4_triton,
)
from qwen_image_fusion.kernels.nvfp4_quant import (
    nvfp4_quant_torch,
    nvfp4_quant_triton,
    swizzle_block_scales,
    unswizzle_block_scales,
)
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.nvfp4 import (
    NVFP4_KEY,
    check_w4a4,
    exact_nvfp4_dot,
    nvfp4_scaled_mm,
    w4a4_target_refusal,
)
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.variants import resolve_variant

ENCODE_SCALES = [1.0, 2.0**-5, 1e-3, 3.7, 37.5, 448.0, 1e30, 1e-30]


def scale_bytes(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.uint8)


# The block-scale layout of torch._scaled_mm's NVFP4 recipe (cuBLAS's 128x4 tiles, 32x4x4 inside).


def cublas_offset(row: int, col: int, col_tiles: int) -> int:
    """cuBLAS's documented place of block scale (row, col): its 128x4 tile, then (row % 32, row // 32 % 4,
    col % 4) within the tile's 512 bytes."""
    tile = (row // 128) * col_tiles + col // 4
    return tile * 512 + (row % 32) * 16 + (row % 128) // 32 * 4 + col % 4


def test_block_scales_are_swizzled_as_cublas_reads_them():
    scales = torch.randint(0, 0x7F, (300, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    swizzled = swizzle_block_scales(scales.view(torch.float8_e4m3fn))
    assert swizzled.shape == (384, 8)  # rows padded to 128, scale columns to 4
    flat = scale_bytes(swizzled).flatten().tolist()
    for row in range(300):
        for col in range(6):
            assert flat[cublas_offset(row, col, 2)] == scales[row, col]
    assert sum(flat) == int(scales.sum())  # the padding is zeros
    assert torch.equal(scale_bytes(unswizzle_block_scales(swizzled, 300, 6)), scales)


# The activation quantizer: kernel (interpreter) against twin, byte for byte.


@needs_interpreter
@pytest.mark.parametrize("encode", ENCODE_SCALES)
def test_quantizer_kernel_is_its_twin_on_every_bf16_value(encode):
    """All 65536 bf16 encodings (inf, NaN, subnormals included) in 64 rows of 1024, each block of 16 a run
    of neighbouring encodings: the kernel computes every narrowing from the fp32 bits, so even Triton's
    interpreter gives the twin's bytes."""
    y = all_bf16().reshape(64, 1024)
    g = torch.tensor([encode])
    with np.errstate(all="ignore"):
        q, s = nvfp4_quant_triton(y, g)
    q_ref, s_ref = nvfp4_quant_torch(y, g)
    assert torch.equal(q, q_ref) and torch.equal(scale_bytes(s), scale_bytes(s_ref))


def e4m3_ties() -> torch.Tensor:
    """The midpoints between neighbouring positive E4M3 values (subnormal and normal), as fp32."""
    values = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return (values[:-1] + values[1:]) / 2


@needs_interpreter
def test_quantizer_rounds_block_scales_at_ties_to_even():
    """Blocks whose scale `amax / 6 * g` (g = 1) lands exactly on each E4M3 midpoint: the kernel and the twin
    take the neighbour with the even code."""
    ties = e4m3_ties()
    y = torch.zeros(len(ties), 16)
    y[:, 3] = 6 * ties  # exact in bf16 (at most 7 significant bits), and 6 * t / 6 == t
    y = y.bfloat16()
    assert torch.equal(y[:, 3].float(), 6 * ties)
    q, s = nvfp4_quant_triton(y, torch.tensor([1.0]))
    q_ref, s_ref = nvfp4_quant_torch(y, torch.tensor([1.0]))
    codes = scale_bytes(unswizzle_block_scales(s, len(ties), 1)).flatten()
    below = torch.arange(len(ties), dtype=torch.uint8)  # tie k lies between codes k and k + 1
    assert torch.equal(codes, below + below % 2)
    assert torch.equal(q, q_ref) and torch.equal(scale_bytes(s), scale_bytes(s_ref))


@needs_interpreter
def test_quantizer_kernel_pads_the_scale_layout_and_takes_3d_rows():
    y = make_inputs(3, 50, 96, seed=4)["x"]  # 150 rows: two row tiles, the second mostly padding
    g = torch.tensor([20.0])
    q, s = nvfp4_quant_triton(y, g)
    q_ref, s_ref = nvfp4_quant_torch(y, g)
    assert q.shape == (150, 48) and s.shape == (256, 8)
    assert torch.equal(q, q_ref) and torch.equal(scale_bytes(s), scale_bytes(s_ref))


def test_quantizer_twin_decodes_within_half_an_e2m1_step():
    y = make_inputs(2, 8, 64, seed=2)["x"].reshape(16, 64)
    g = torch.tensor([100.0])
    q, s = nvfp4_quant_torch(y, g)
    scales = unswizzle_block_scales(s, 16, 4)
    decoded = dequantize_nvfp4(q, scales).float() / g
    unit = (scales.float() / g).repeat_interleave(16, dim=-1)
    assert bool(((decoded - y.float()).abs() <= unit * (1 + 2.0**-20)).all())


# The producers: LayerNorm + modulate (+ the gated residual) + NVFP4.


@pytest.mark.slow  # 7 s: 650 interpreted programs
@needs_interpreter
@pytest.mark.parametrize("per_token", [False, True])
def test_producer1_fused_equals_unfused_and_quantizes_its_own_y(per_token):
    t = make_inputs(2, 65, 64, seed=1, target=40 if per_token else None)  # 130 rows: two scale tiles
    index = t.get("mod_index")
    g = torch.tensor([37.5])
    args = (t["x"], t["shift"], t["scale"], EPS, g)
    y, q_none, s_none = layer_norm_modulate_nvfp4_triton(*args, True, False, index)  # unfused: y only
    q_unfused, s_unfused = nvfp4_quant_triton(y, g)
    y_fused, q, s = layer_norm_modulate_nvfp4_triton(*args, True, True, index)
    y_none, q_only, s_only = layer_norm_modulate_nvfp4_triton(*args, False, True, index)
    assert q_none is None and s_none is None and y_none is None
    assert same_bytes(y_fused, y) and torch.equal(q, q_unfused) and torch.equal(q_only, q_unfused)
    assert torch.equal(scale_bytes(s), scale_bytes(s_unfused)) and torch.equal(
        scale_bytes(s_only), scale_bytes(s)
    )
    q_ref, s_ref = nvfp4_quant_torch(y, g)  # the codes are the quantizer's of the kernel's own y
    assert torch.equal(q, q_ref) and torch.equal(scale_bytes(s), scale_bytes(s_ref))
    # y is the FP8 producer's arithmetic (one row function): equal under the interpreter
    assert same_bytes(y, layer_norm_modulate_triton(*args[:4], mod_index=index)[0])


@pytest.mark.slow  # 7 s: 650 interpreted programs
@needs_interpreter
@pytest.mark.parametrize("per_token", [False, True])
def test_producer2_fused_equals_unfused_and_quantizes_its_own_y(per_token):
    t = make_inputs(2, 65, 64, seed=3, target=40 if per_token else None)
    index = t.get("mod_index")
    g = torch.tensor([12.0])
    args = (t["residual"], t["gate"], t["x"], t["shift"], t["scale"], EPS, g)
    r, y, _, _ = gated_residual_layer_norm_modulate_nvfp4_triton(*args, True, False, index)
    r_fused, y_fused, q, s = gated_residual_layer_norm_modulate_nvfp4_triton(*args, True, True, index)
    r_only, _, q_only, _ = gated_residual_layer_norm_modulate_nvfp4_triton(*args, False, True, index)
    q_unfused, s_unfused = nvfp4_quant_triton(y, g)
    assert same_bytes(r_fused, r) and same_bytes(r_only, r) and same_bytes(y_fused, y)
    assert torch.equal(q, q_unfused) and torch.equal(q_only, q_unfused)
    assert torch.equal(scale_bytes(s), scale_bytes(s_unfused))
    fp8_r, fp8_y, _ = gated_residual_layer_norm_modulate_triton(*args[:6], mod_index=index)
    assert same_bytes(r, fp8_r) and same_bytes(y, fp8_y)


def test_producer_twins_are_the_contract_then_the_quantizer():
    t = make_inputs(2, 5, 64, seed=5)
    g = torch.tensor([9.0])
    r, y, q, s = gated_residual_layer_norm_modulate_nvfp4_torch(
        t["residual"], t["gate"], t["x"], t["shift"], t["scale"], EPS, g
    )
    q_ref, s_ref = nvfp4_quant_torch(y, g)
    assert torch.equal(q, q_ref) and torch.equal(scale_bytes(s), scale_bytes(s_ref))
    y1, q1, s1 = layer_norm_modulate_nvfp4_torch(r, t["shift"], t["scale"], EPS, g, write_y=False)
    assert y1 is None and torch.equal(q1, q) and torch.equal(scale_bytes(s1), scale_bytes(s))


@needs_interpreter
def test_a_producer_of_y_alone_needs_no_encode_scale():
    t = make_inputs(1, 3, 32)
    y, q, s = layer_norm_modulate_nvfp4_triton(t["x"], t["shift"], t["scale"], EPS, None, True, False)
    assert y is not None and q is None and s is None
    assert layer_norm_modulate_nvfp4_triton(t["x"], t["shift"], t["scale"], EPS, None, True, True) is None


# The W4A4 GEMM's arithmetic, through its twin.


def nvfp4_rows(values: list[list[float]], scales: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and E4M3 block scales of rows given as E2M1 values and one scale per 16."""
    codes = torch.tensor([[_code(v) for v in row] for row in values], dtype=torch.uint8)
    return pack_e2m1(codes), torch.tensor(scales).to(torch.float8_e4m3fn)


def _code(value: float) -> int:
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return magnitudes.index(abs(value)) | (8 if value < 0 else 0)


def test_the_dot_is_exact_where_float64_would_round_a_tie_the_other_way():
    """16384 products of 2^20 (E2M1 4 x E4M3 256, both ways), one of 2^10 (4 x 8) and one unit (2^-20:
    0.5 x 2^-9, both ways): exactly 2^34 + 2^10 + 2^-20, just above the fp32 midpoint 2^34 + 2^10, so it
    rounds up to 2^34 + 2^11. Float64 cannot hold the sum (55 bits): without the unit, the midpoint rounds to
    even, 2^34."""
    values = [0.5] + [0.0] * 15 + [4.0] + [0.0] * 15 + [4.0] * 16384
    scales = [[2.0**-9, 8.0] + [256.0] * 1024]
    a, a_scale = nvfp4_rows([values], scales)
    products = (dequantize_nvfp4(a, a_scale).double() ** 2).flatten().tolist()
    assert np.float32(sum(products)) == 2.0**34  # float64, left to right: the unit is gone
    assert exact_nvfp4_dot(a, a_scale, a, a_scale).tolist() == [[2.0**34 + 2.0**11]]


def test_a_nan_block_scale_makes_its_row_nan():
    a, a_scale = nvfp4_rows([[1.0] * 16, [2.0] * 16], [[1.0], [1.0]])
    a_scale.view(torch.uint8)[1] = 0x7F  # what the quantizer writes for a block holding NaN
    w, w_scale = nvfp4_rows([[1.0] * 16], [[2.0]])
    got = exact_nvfp4_dot(a, a_scale, w, w_scale)
    assert got[0].tolist() == [32.0] and bool(got[1].isnan().all())


def test_the_dot_equals_float64_where_float64_is_exact():
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(5, 64, generator=gen)
    w = torch.randn(7, 64, generator=gen)
    (qa, sa), (qw, sw) = (quantize_nvfp4(t, torch.tensor([2.0])) for t in (a, w))
    reference = dequantize_nvfp4(qa, sa).double() @ dequantize_nvfp4(qw, sw).double().t()  # 4 blocks: exact
    assert torch.equal(exact_nvfp4_dot(qa, sa, qw, sw), reference.float())


def test_the_w4a4_twin_is_the_exact_dot_times_alpha_plus_bias_rounded_once():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 64, generator=gen).bfloat16()
    qw, sw = quantize_nvfp4(torch.randn(10, 64, generator=gen), torch.tensor([300.0]))
    qa, swizzled = nvfp4_quant_torch(x, torch.tensor([50.0]))
    input_scale, weight_scale_2 = torch.tensor(0.02), torch.tensor(1 / 300.0)
    alpha = input_scale * weight_scale_2
    bias = torch.randn(10, generator=gen).bfloat16()
    got = nvfp4_scaled_mm(qa, swizzled, input_scale, qw, sw, weight_scale_2, alpha, bias, torch.bfloat16)
    dot = exact_nvfp4_dot(qa, unswizzle_block_scales(swizzled, 6, 4), qw, sw)
    assert torch.equal(got, (dot * alpha + bias.float()).bfloat16())
    full = x.float() @ (dequantize_nvfp4(qw, sw).float() * weight_scale_2).t() + bias.float()
    assert float((got.float() - full).abs().max()) < 0.25 * float(full.abs().max())  # 4-bit activations


# The gate: W4A4 on capability 10 or later, and on the CPU; refused in one line elsewhere.


@pytest.mark.parametrize(
    ("capability", "refused"), [((8, 9), True), ((9, 0), True), ((10, 0), False), ((12, 0), False)]
)
def test_w4a4_runs_only_on_fp4_tensor_cores(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    reason = w4a4_target_refusal(torch.device("cuda"))
    assert bool(reason) == refused
    if refused:
        assert reason == (
            f"CUDA capability {capability[0]}.{capability[1]} has no FP4 tensor cores: NVFP4 W4A4 needs "
            "10.0 or later (Blackwell)"
        )
        with pytest.raises(InputError, match=r"the nvfp4 variant \(the weight path\) runs here") as raised:
            check_w4a4(torch.device("cuda"))
        assert len(str(raised.value).splitlines()) == 1
    assert w4a4_target_refusal(torch.device("cpu")) == ""


def test_auto_never_picks_w4a4():
    from qwen_image_fusion.models.checkpoint import WeightFormat

    assert resolve_variant("auto", WeightFormat.NVFP4).name == "nvfp4"
    assert resolve_variant("nvfp4-w4a4-fused", WeightFormat.NVFP4).w4a4


# A whole NVFP4 checkpoint on W4A4, on the CPU (the twins).


@pytest.mark.cpu_dtype
def test_w4a4_fused_and_unfused_pngs_are_byte_identical(nvfp4_dir, monkeypatch):  # noqa: F811
    pipe = load_pipeline(nvfp4_dir, device="cpu")
    args = dict(negative_prompt="blurry", width=48, height=32, num_inference_steps=3, seed=11)
    weight_path = [png_sha256(im) for im in pipe.generate(["a red fox", "a blue bird"], **args)]
    pipe.set_variant("nvfp4-w4a4-fused")
    layers = pipe.transformer.config.num_layers
    paths = 4 * (layers - 4)  # the producer paths of the NVFP4 blocks (not the BF16 edge blocks)
    summary = pipe.fusion_summary().splitlines()
    assert pipe.variant == "nvfp4-w4a4-fused"
    assert summary[0] == f"NVFP4 norm+quant fusion: {paths}/{4 * layers} block paths"
    fused = [png_sha256(im) for im in pipe.generate(["a red fox", "a blue bird"], **args)]
    step_without_host_sync(pipe.transformer, (1, 4, 4))  # quantizers, swizzles and the exact dot included
    pipe.set_variant("nvfp4-w4a4-unfused")
    assert pipe.fusion_summary().splitlines()[0] == f"NVFP4 norm+quant fusion: 0/{4 * layers} block paths"
    producer = pipe.transformer.transformer_blocks[2].img_norm1  # unfused, y from the NVFP4 binary still
    assert producer.quant.quant_key == NVFP4_KEY and not producer.quant.write_q
    unfused = [png_sha256(im) for im in pipe.generate(["a red fox", "a blue bird"], **args)]
    assert fused == unfused and fused != weight_path and fused[0] != fused[1]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    pipe.device = torch.device("cuda")  # as if loaded on an H200: refused before anything changes
    with pytest.raises(InputError, match=r"CUDA capability 9\.0 has no FP4 tensor cores"):
        pipe.set_variant("nvfp4-w4a4-fused")
    assert pipe.variant == "nvfp4-w4a4-unfused"
    assert pipe.available_variants() == ["nvfp4"]  # what the demo's picker offers there
