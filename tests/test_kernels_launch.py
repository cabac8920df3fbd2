"""Every Triton entry point launches; the sm_90 binaries obey DESIGN §4 (compiled here, no GPU needed).

`compile_report` runs in a subprocess without the interpreter: it records the launches the public
functions make, keys them with Triton's own specializer, compiles them for sm_90 and counts the PTX
instructions the contract forbids or requires.
"""

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from ptx_probe import binary_key, ptx_counts, record_launches, report_from_subprocess
from test_kernels_quant import needs_interpreter

from qwen_image_fusion.kernels.gelu_quant import gelu_tanh_quant_triton, gelu_tanh_triton
from qwen_image_fusion.kernels.norm_modulate import (
    gated_residual_layer_norm_modulate_triton,
    gated_residual_triton,
    layer_norm_modulate_triton,
)
from qwen_image_fusion.kernels.quant import inverse_scale, static_quant_fp8_triton

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
B, L = 2, 3


def _tensors(width: int):
    g = torch.Generator().manual_seed(0)
    act = [torch.randn(B, L, width, generator=g).to(BF16) for _ in range(2)]
    mods = [torch.randn(B, width, generator=g).to(BF16) for _ in range(3)]
    return act, mods, inverse_scale(torch.tensor(0.01))


def _per_token(width: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """gate, shift, scale as [2B, D] rows and the Edit-2511 index: token 0 of each sample on its own row,
    the others on the t = 0 rows B..2B-1."""
    g = torch.Generator().manual_seed(1)
    mods = [torch.randn(2 * B, width, generator=g).to(BF16) for _ in range(3)]
    index = torch.arange(B, dtype=torch.int32)[:, None] + B * (torch.arange(L) > 0).int()
    return mods, index.int()


def _variants(width: int = 48):
    """(name, call, expected dtype per returned slot, None where absent) for every entry point and mode."""
    (res, x), (gate, shift, scale), inv = _tensors(width)
    p2 = (res, gate, x, shift, scale, 1e-6)
    (gate_t, shift_t, scale_t), index = _per_token(width)
    p1_t = (x, shift_t, scale_t, 1e-6)
    p2_t = (res, gate_t, x, shift_t, scale_t, 1e-6)
    return [
        ("quant", lambda: static_quant_fp8_triton(x, inv), FP8),
        ("p1 y", lambda: layer_norm_modulate_triton(x, shift, scale, 1e-6), (BF16, None)),
        ("p1 y+q", lambda: layer_norm_modulate_triton(x, shift, scale, 1e-6, inv), (BF16, FP8)),
        ("p1 q", lambda: layer_norm_modulate_triton(x, shift, scale, 1e-6, inv, False), (None, FP8)),
        ("p1 none", lambda: layer_norm_modulate_triton(x, shift, scale, 1e-6, None, False), (None, None)),
        ("p2 y", lambda: gated_residual_layer_norm_modulate_triton(*p2), (BF16, BF16, None)),
        ("p2 y+q", lambda: gated_residual_layer_norm_modulate_triton(*p2, inv), (BF16, BF16, FP8)),
        ("p2 q", lambda: gated_residual_layer_norm_modulate_triton(*p2, inv, False), (BF16, None, FP8)),
        ("p2 r", lambda: gated_residual_layer_norm_modulate_triton(*p2, None, False), (BF16, None, None)),
        ("residual", lambda: gated_residual_triton(res, gate, x), BF16),
        ("p1 y token", lambda: layer_norm_modulate_triton(*p1_t, mod_index=index), (BF16, None)),
        ("p1 y+q token", lambda: layer_norm_modulate_triton(*p1_t, inv, mod_index=index), (BF16, FP8)),
        ("p1 q token", lambda: layer_norm_modulate_triton(*p1_t, inv, False, index), (None, FP8)),
        (
            "p2 y token",
            lambda: gated_residual_layer_norm_modulate_triton(*p2_t, mod_index=index),
            (BF16, BF16, None),
        ),
        (
            "p2 y+q token",
            lambda: gated_residual_layer_norm_modulate_triton(*p2_t, inv, True, index),
            (BF16, BF16, FP8),
        ),
        (
            "p2 q token",
            lambda: gated_residual_layer_norm_modulate_triton(*p2_t, inv, False, index),
            (BF16, None, FP8),
        ),
        ("residual token", lambda: gated_residual_triton(res, gate_t, x, index), BF16),
        ("gelu", lambda: gelu_tanh_triton(x), BF16),
        ("gelu q", lambda: gelu_tanh_quant_triton(x, inv), (None, FP8)),
        ("gelu g+q", lambda: gelu_tanh_quant_triton(x, inv, True), (BF16, FP8)),
    ]


@needs_interpreter
@pytest.mark.parametrize("name, call, expected", _variants(), ids=[v[0] for v in _variants()])
def test_every_variant_launches(name, call, expected):
    out = call()
    got = tuple(None if t is None else t.dtype for t in out) if isinstance(out, tuple) else out.dtype
    assert got == expected, name
    for t in out if isinstance(out, tuple) else (out,):
        assert t is None or t.shape == (B, L, 48)


def compile_report() -> dict:
    """Launches recorded (not run) at the model's width, keyed by Triton's specializer, compiled for sm_90.

    Returns {kernel: {"launches", "keys": distinct binaries, "ptx": instruction counts}}.
    """
    from qwen_image_fusion.kernels import _triton_common, gelu_quant, norm_modulate, quant

    for module in (quant, _triton_common, gelu_quant):  # CPU tensors stand in for CUDA ones
        module.launchable = lambda kernel, *tensors: True
    kernels = {
        "quant": quant._static_quant_fp8_kernel,
        "producer1": norm_modulate._layer_norm_modulate_kernel,
        "producer2": norm_modulate._gated_residual_layer_norm_modulate_kernel,
        "gelu": gelu_quant._gelu_tanh_quant_kernel,
    }
    calls = {name: record_launches(kernel) for name, kernel in kernels.items()}
    # the unfused path's producer launch (y only) and every fused mode of each kernel, per sample or token
    for name, call, _ in _variants(3072):
        if name not in ("p1 none", "p2 r", "residual", "residual token"):
            call()
    report = {}
    for name, kernel in kernels.items():
        keys = {binary_key(kernel, args, kwargs) for args, kwargs in calls[name]}
        report[name] = {
            "launches": len(calls[name]),
            "keys": len(keys),
            "ptx": ptx_counts(kernel, *calls[name][0]),
        }
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    return report_from_subprocess(__file__)


@pytest.mark.parametrize("name, launches", [("quant", 1), ("producer1", 6), ("producer2", 6), ("gelu", 3)])
def test_fused_and_unfused_launches_share_one_binary(report, name, launches):
    assert report[name]["launches"] == launches
    assert report[name]["keys"] == 1


@pytest.mark.parametrize("name", ["quant", "producer1", "producer2"])
def test_ptx_follows_the_contract(report, name):
    ptx = report[name]["ptx"]
    assert ptx["fma"] == 0
    if name != "quant":  # the quantizer has no a * b + c to contract; here the probe must see some
        assert ptx["fma_if_fusion_allowed"] > 0
    assert ptx["div_inexact"] == 0 and ptx["inexact_sqrt_or_rcp"] == 0 and ptx["ftz"] == 0
    assert ptx["cvt_e4m3"] > 0 and ptx["min_max_plain"] == 0  # clamp: only NaN-propagating min/max
    assert ptx["min_max_nan"] > 0
    if name != "quant":
        assert ptx["div_rn"] == 3 and ptx["sqrt_rn"] == 1 and ptx["cvt_bf16"] > 0  # mean, var, 1/sqrt


def test_gelu_ptx_does_not_contract_its_own_ops(report):
    ptx = report["gelu"]["ptx"]
    # libdevice's tanhf keeps its own FMAs; allowing contraction would add ours on top
    assert ptx["fma"] < ptx["fma_if_fusion_allowed"]
    assert ptx["cvt_e4m3"] > 0 and ptx["min_max_plain"] == 0 and ptx["min_max_nan"] > 0


def test_gelu_ptx_approximates_only_inside_tanhf(report):
    """DESIGN §4: tanh is libdevice's `tanhf` (at most 2 ulps), not the hardware `tanh.approx`
    (about 2^-11 relative); tanhf's own approximate ex2 and rcp (one of each per element, ftz) are the
    only approximate or ftz instructions; GELU has no division or sqrt of its own."""
    ptx = report["gelu"]["ptx"]
    assert ptx["tanh_approx"] == 0 and ptx["div_inexact"] == 0 and ptx["div_rn"] == 0
    assert ptx["sqrt_rn"] == 0 and ptx["inexact_sqrt_or_rcp"] == ptx["rcp_approx"]
    assert ptx["ex2_approx"] == ptx["rcp_approx"] > 0
    assert ptx["ftz"] == ptx["ex2_approx"] + ptx["rcp_approx"]


def test_kernels_import_and_fall_back_without_triton():
    code = """
import sys
sys.modules["triton"] = None
import torch
from qwen_image_fusion.kernels import gelu_quant, norm_modulate, quant
x = torch.randn(1, 2, 32).bfloat16(); m = torch.randn(1, 32).bfloat16(); inv = torch.ones(1)
assert norm_modulate.layer_norm_modulate_triton(x, m, m, 1e-6, inv) is None
assert quant.static_quant_fp8_triton(x, inv) is None and gelu_quant.gelu_tanh_triton(x) is None
y, q = norm_modulate.layer_norm_modulate(x, m, m, 1e-6, inv)
assert torch.equal(q.view(torch.uint8), quant.static_quant_fp8_torch(y, inv).view(torch.uint8))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]


if __name__ == "__main__":
    print(json.dumps(compile_report()))
