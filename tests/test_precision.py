"""The CPU dtypes follow what the CPU computes natively (issue: BF16 convolutions and matmuls are several
times slower than FP32 on CPUs without AVX-512 BF16 or AMX); `--dtype` overrides; the choice is reported."""

import pytest
import torch

from pipelines import pipeline
from pipelines.pipeline import pick_precision
from pipelines.variants import get_variant, resolve_variant
from ui.cli import main

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("native", "variant", "dtype", "vae_dtype"),
    [
        (True, "contract", torch.bfloat16, torch.bfloat16),
        (True, "reference", torch.bfloat16, torch.bfloat16),
        (False, "contract", torch.bfloat16, torch.float32),  # the contract is defined in BF16
        (False, "fp8-fused", torch.bfloat16, torch.float32),
        (False, "reference", torch.float32, torch.float32),
    ],
)
def test_cpu_dtypes_follow_native_bf16(monkeypatch, native, variant, dtype, vae_dtype):
    monkeypatch.setattr(pipeline, "native_bf16", lambda device: native)
    chosen = pick_precision(None, CPU, get_variant(variant))
    assert (chosen.dtype, chosen.vae_dtype) == (dtype, vae_dtype)
    assert ("no native BF16" in chosen.reason) == (not native)


def test_an_explicit_dtype_wins_everywhere():
    chosen = pick_precision(torch.bfloat16, CPU, get_variant("reference"))
    assert (chosen.dtype, chosen.vae_dtype, chosen.reason) == (
        torch.bfloat16,
        torch.bfloat16,
        "as asked (--dtype)",
    )


def test_auto_prefers_the_reference_arithmetic_only_where_bf16_is_slow():
    assert resolve_variant("auto", fp8_weights=False).name == "contract"
    assert resolve_variant("auto", fp8_weights=False, prefer_reference=True).name == "reference"
    assert resolve_variant("auto", fp8_weights=True, prefer_reference=True).name == "fp8-fused"


def test_info_and_the_run_summary_say_what_was_chosen(tmp_path, capsys):
    reason = pick_precision(None, CPU, get_variant("reference")).reason
    assert main(["info", "--device", "cpu"]) == 0
    assert reason in capsys.readouterr().out
    args = ["--device", "cpu", "--dtype", "fp32", "--width", "32", "--height", "32", "--steps", "2"]
    assert main(["generate", "a fox", "-o", str(tmp_path / "a.png"), *args]) == 0
    assert "float32: as asked (--dtype)" in capsys.readouterr().out
