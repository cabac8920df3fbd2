"""The NVFP4 Triton kernels compile for sm_90 here (no GPU needed; tests/ptx_probe.py). The weight path: a few
rows (the modulation linears) run one GEMM whose tiles become tensor-core MMAs on BF16; token rows decode the
weight once (one launch covering it) and round the fp32 sums in an epilogue launch; every epilogue keeps its
two fp32 roundings (no FMA), as the torch twin rounds. The W4A4 producers and the activation quantizer: every
mode of a producer (y, q, both) is one binary, with no FMA, IEEE division and sqrt, NaN-propagating clamps
and no E4M3 conversion instruction (codes from the bits)."""

import json
import re

import pytest
import torch
from ptx_probe import PTX_PATTERNS, binary_key, ptx_counts, record_launches, report_from_subprocess, sm90_ptx

PATTERNS = {
    **PTX_PATTERNS,
    "wgmma_bf16": r"\bwgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16",
    "mma_bf16": r"\bmma\.sync\.aligned\.\w+\.row\.col\.f32\.bf16\.bf16\.f32",
    "cvt_bf16": r"\bcvt\.rn\.bf16(x2)?\.f32",
}


def compile_report() -> dict:
    """The launches `nvfp4_linear_triton` makes for 2 and 4096 rows at a model shape (N = 256, K = 3072),
    recorded (not run) and compiled for sm_90: per kernel, its launch count and the instruction counts of its
    last launch; and the producers' and quantizer's: their launches, distinct binaries and counts."""
    from qwen_image_fusion.kernels import _triton_common, nvfp4, nvfp4_quant
    from qwen_image_fusion.models.nvfp4 import quantize_nvfp4_weight

    for module in (nvfp4, nvfp4_quant, _triton_common):  # CPU tensors stand in for CUDA ones
        module.launchable = lambda kernel, *tensors: True
    kernels = {
        "gemm": nvfp4._nvfp4_linear_kernel,
        "decode": nvfp4._nvfp4_decode_kernel,
        "epilogue": nvfp4._nvfp4_epilogue_kernel,
    }
    packed, block_scale, weight_scale_2 = quantize_nvfp4_weight(torch.randn(256, 3072))
    report = {}
    for rows in (2, 4096):
        calls = {name: record_launches(kernel) for name, kernel in kernels.items()}
        x = torch.randn(rows, 3072).bfloat16()
        nvfp4.nvfp4_linear_triton(
            x, packed, block_scale, weight_scale_2.reshape(1), torch.zeros(256).bfloat16()
        )
        report[rows] = {
            name: {
                "launches": len(calls[name]),
                **({"ptx": ptx_counts_of(kernels[name], *calls[name][-1])} if calls[name] else {}),
            }
            for name in kernels
        }
    return report | producer_report()


def ptx_counts_of(kernel, args: tuple, kwargs: dict) -> dict[str, int]:
    """This file's instruction counts (the BF16 MMAs and conversions too) of one recorded launch."""
    code = sm90_ptx(kernel, args, kwargs)
    return {name: len(re.findall(pattern, code)) for name, pattern in PATTERNS.items()}


def producer_report() -> dict:
    """Every mode of each NVFP4 producer at the model's width, and the quantizer, compiled for sm_90."""
    from qwen_image_fusion.kernels import nvfp4_producers, nvfp4_quant

    kernels = {
        "producer1": nvfp4_producers._layer_norm_modulate_nvfp4_kernel,
        "producer2": nvfp4_producers._gated_residual_layer_norm_modulate_nvfp4_kernel,
        "quant": nvfp4_quant._nvfp4_quant_kernel,
    }
    calls = {name: record_launches(kernel) for name, kernel in kernels.items()}
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(2, 5, 3072, generator=gen).bfloat16() for _ in range(2))
    gate, shift, scale = (torch.randn(2, 3072, generator=gen).bfloat16() for _ in range(3))
    g = torch.tensor([20.0])
    for write_y, write_q in ((True, False), (True, True), (False, True)):
        encode = g if write_q else None
        nvfp4_producers.layer_norm_modulate_nvfp4_triton(x, shift, scale, 1e-6, encode, write_y, write_q)
        nvfp4_producers.gated_residual_layer_norm_modulate_nvfp4_triton(
            res, gate, x, shift, scale, 1e-6, encode, write_y, write_q
        )
    nvfp4_quant.nvfp4_quant_triton(x, g)
    return {
        name: {
            "launches": len(calls[name]),
            "keys": len({binary_key(kernel, args, kwargs) for args, kwargs in calls[name]}),
            "ptx": ptx_counts(kernel, *calls[name][-1]),
        }
        for name, kernel in kernels.items()
    }


@pytest.fixture(scope="module")
def report() -> dict:
    return report_from_subprocess(__file__)


def test_token_rows_decode_the_weight_once_and_round_in_an_epilogue_without_fma(report):
    launches = report["4096"]
    assert launches["gemm"]["launches"] == 0
    assert launches["decode"]["launches"] == 1 and launches["epilogue"]["launches"] == 1
    for name in ("decode", "epilogue"):
        ptx = launches[name]["ptx"]
        assert ptx["fma"] == 0 and ptx["cvt_bf16"] > 0


def test_a_few_rows_run_on_mma_sync_in_one_gemm(report):
    launches = report["2"]
    assert launches["decode"]["launches"] == 0 and launches["epilogue"]["launches"] == 0
    ptx = launches["gemm"]["ptx"]
    assert launches["gemm"]["launches"] == 1
    assert ptx["mma_bf16"] > 0 and ptx["fma"] == 0 and ptx["cvt_bf16"] > 0


@pytest.mark.parametrize(("name", "launches"), [("producer1", 3), ("producer2", 3), ("quant", 1)])
def test_every_mode_of_a_w4a4_producer_is_one_binary(report, name, launches):
    assert report[name]["launches"] == launches and report[name]["keys"] == 1


@pytest.mark.parametrize("name", ["producer1", "producer2", "quant"])
def test_w4a4_ptx_follows_the_contract(report, name):
    ptx = report[name]["ptx"]
    assert ptx["fma"] == 0 and ptx["fma_if_fusion_allowed"] > 0  # the probe sees what fusion would contract
    assert ptx["div_inexact"] == 0 and ptx["inexact_sqrt_or_rcp"] == 0 and ptx["ftz"] == 0
    assert ptx["cvt_e4m3"] == 0  # E4M3 codes from the fp32 bits
    assert ptx["min_max_plain"] == 0 and ptx["min_max_nan"] > 0  # the scale's clamp keeps NaN
    assert ptx["div_rn"] > 0  # amax / 6 and g / s per block of 16 (and the LN's), each IEEE
    if name != "quant":
        assert ptx["sqrt_rn"] == 1 and ptx["cvt_bf16"] > 0


if __name__ == "__main__":
    print(json.dumps(compile_report()))
