"""The CPU dtypes follow what the CPU computes natively (issue: BF16 convolutions and matmuls are several
times slower than FP32 on CPUs without AVX-512 BF16 or AMX); `--dtype` overrides; the choice is reported."""

import pytest
import torch

from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines.precision import CPU_DTYPE_ENV, native_bf16, pick_precision
from qwen_image_fusion.pipelines.variants import get_variant, resolve_variant
from qwen_image_fusion.ui.cli import main

CPU = torch.device("cpu")
CAPABILITY = torch.backends.cpu.get_cpu_capability()


@pytest.mark.parametrize(
    ("forced", "variant", "dtype", "vae_dtype"),
    [
        ("bf16", "contract", torch.bfloat16, torch.bfloat16),
        ("bf16", "reference", torch.bfloat16, torch.bfloat16),
        ("fp32", "contract", torch.bfloat16, torch.float32),  # the contract is defined in BF16
        ("fp32", "fp8-fused", torch.bfloat16, torch.float32),
        ("fp32", "reference", torch.float32, torch.float32),
    ],
)
def test_cpu_dtypes_follow_native_bf16(monkeypatch, forced, variant, dtype, vae_dtype):
    """QWEN_IMAGE_CPU_DTYPE picks the defaults as on a CPU with (bf16) or without (fp32) native BF16."""
    monkeypatch.setenv(CPU_DTYPE_ENV, forced)
    chosen = pick_precision(None, CPU, get_variant(variant))
    assert (chosen.dtype, chosen.vae_dtype) == (dtype, vae_dtype)
    assert f"{CPU_DTYPE_ENV}={forced}" in chosen.reason
    assert ("no native BF16" in chosen.reason) == (forced == "fp32")


def test_unset_the_cpu_says(monkeypatch):
    """Without the override the CPU's own flags decide (AVX-512 BF16 or AMX), and the reason says which."""
    monkeypatch.delenv(CPU_DTYPE_ENV)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert native_bf16(CPU) == native
    reason = pick_precision(None, CPU, get_variant("reference")).reason
    assert reason == (
        "cpu computes BF16 natively" if native else f"this CPU ({CAPABILITY}) has no native BF16"
    )
    assert native_bf16(torch.device("cuda"))  # every GPU we run on; no CUDA needed to say so


def test_an_override_that_is_no_dtype_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv(CPU_DTYPE_ENV, "fp16")
    with pytest.raises(InputError, match="QWEN_IMAGE_CPU_DTYPE='fp16' is not bf16 or fp32"):
        pick_precision(None, CPU, get_variant("reference"))
    assert main(["generate", "a fox", "--device", "cpu", "--steps", "2", "-o", "never.png"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "error: QWEN_IMAGE_CPU_DTYPE='fp16' is not bf16 or fp32 (unset: what this CPU computes natively)"
    )
    assert "Traceback" not in err


def test_an_explicit_dtype_wins_everywhere():
    chosen = pick_precision(torch.bfloat16, CPU, get_variant("reference"))
    assert (chosen.dtype, chosen.vae_dtype, chosen.reason) == (
        torch.bfloat16,
        torch.bfloat16,
        "as asked (--dtype)",
    )


def test_auto_prefers_the_reference_arithmetic_only_where_bf16_is_slow():
    assert resolve_variant("auto", WeightFormat.BF16).name == "contract"
    assert resolve_variant("auto", WeightFormat.BF16, prefer_reference=True).name == "reference"
    assert resolve_variant("auto", WeightFormat.FP8, prefer_reference=True).name == "fp8-fused"
    assert resolve_variant("auto", WeightFormat.NVFP4, prefer_reference=True).name == "nvfp4"


@pytest.mark.cpu_dtype
def test_info_and_the_run_summary_say_what_was_chosen(tmp_path, capsys):
    reason = pick_precision(None, CPU, get_variant("reference")).reason
    assert main(["info", "--device", "cpu"]) == 0
    assert reason in capsys.readouterr().out
    args = ["--device", "cpu", "--dtype", "fp32", "--width", "32", "--height", "32", "--steps", "2"]
    assert main(["generate", "a fox", "-o", str(tmp_path / "a.png"), *args]) == 0
    assert "float32: as asked (--dtype)" in capsys.readouterr().out
