"""The NVFP4 weight path's Triton GEMM compiles for sm_90 here (no GPU needed; tests/ptx_probe.py): both tile
shapes it launches (a few rows: the modulation linears; token rows) become tensor-core MMAs on BF16, and the
epilogue keeps its two fp32 roundings (no FMA), as the torch twin rounds."""

import json
import re

import pytest
import torch
from ptx_probe import record_launches, report_from_subprocess, sm90_ptx

PATTERNS = {
    "fma": r"\bfma\.rn\.f32",
    "wgmma_bf16": r"\bwgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16",
    "mma_bf16": r"\bmma\.sync\.aligned\.\w+\.row\.col\.f32\.bf16\.bf16\.f32",
    "cvt_bf16": r"\bcvt\.rn\.bf16(x2)?\.f32",
}


def compile_report() -> dict:
    """The launches `nvfp4_linear_triton` makes for 2 and 4096 rows at a model shape (K = 3072), recorded
    (not run) and compiled for sm_90: {rows: instruction counts}."""
    from qwen_image_fusion.kernels import nvfp4
    from qwen_image_fusion.models.nvfp4 import quantize_nvfp4_weight

    nvfp4.launchable = lambda kernel, *tensors: True  # CPU tensors stand in for CUDA ones
    calls = record_launches(nvfp4._nvfp4_linear_kernel)
    packed, block_scale, weight_scale_2 = quantize_nvfp4_weight(torch.randn(256, 3072))
    for rows in (2, 4096):
        x = torch.randn(rows, 3072).bfloat16()
        nvfp4.nvfp4_linear_triton(
            x, packed, block_scale, weight_scale_2.reshape(1), torch.zeros(256).bfloat16()
        )
    report = {}
    for rows, (args, kwargs) in zip((2, 4096), calls, strict=True):
        code = sm90_ptx(nvfp4._nvfp4_linear_kernel, args, kwargs)
        report[rows] = {name: len(re.findall(pattern, code)) for name, pattern in PATTERNS.items()}
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    return report_from_subprocess(__file__)


def test_token_rows_run_on_hopper_warpgroup_mmas(report):
    ptx = report["4096"]
    assert ptx["wgmma_bf16"] > 0 and ptx["fma"] == 0 and ptx["cvt_bf16"] > 0


def test_a_few_rows_run_on_mma_sync(report):
    ptx = report["2"]
    assert ptx["mma_bf16"] > 0 and ptx["fma"] == 0 and ptx["cvt_bf16"] > 0


if __name__ == "__main__":
    print(json.dumps(compile_report()))
