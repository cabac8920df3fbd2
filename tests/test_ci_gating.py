"""tests/conftest.py: a missing tool skips a test, except under CI=true, where the test fails with why; a test
reads the CPU's default dtype only with the `cpu_dtype` mark."""

import os
import subprocess
import sys
import types
from pathlib import Path

import conftest
import pytest
import torch
from helpers import REPO

import qwen_image_fusion.kernels._triton_common as triton_common
from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines.precision import CPU_DTYPE_ENV, pick_numerics


def item(marker: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(keywords={marker: True})


@pytest.mark.parametrize(
    "marker, reason",
    [
        ("browser", "/nonexistent/chromium not found"),
        ("interpreter", "Triton's CPU interpreter is off"),
    ],
)
def test_missing_tool_skips_outside_ci_and_fails_in_ci(
    monkeypatch: pytest.MonkeyPatch, marker: str, reason: str
) -> None:
    monkeypatch.setattr(conftest, "CHROMIUM", Path("/nonexistent/chromium"))
    monkeypatch.setattr(triton_common, "interpreted", lambda kernel: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=reason):
        conftest.pytest_runtest_setup(item(marker))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=f"CI=true: this test must run, but {reason}"):
        conftest.pytest_runtest_setup(item(marker))


def test_a_test_without_the_cpu_dtype_mark_cannot_read_the_cpu_default() -> None:
    """This test has no `cpu_dtype` mark: the CPU's default dtype is refused here and in a process it
    starts, naming the mark; an explicit dtype reads nothing and works."""
    cpu = torch.device("cpu")
    with pytest.raises(InputError, match="not marked cpu_dtype"):
        pick_numerics(WeightFormat.BF16, "auto", cpu)
    info = subprocess.run(
        [sys.executable, "-m", "qwen_image_fusion.ui.cli", "info", "--device", "cpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert info.returncode == 2 and "not marked cpu_dtype" in info.stderr.splitlines()[-1], info.stderr
    assert pick_numerics(WeightFormat.BF16, "auto", cpu, "fp32")[1].dtype == torch.float32


@pytest.mark.cpu_dtype
def test_a_marked_test_reads_the_cpu_default() -> None:
    variant, precision = pick_numerics(WeightFormat.BF16, "auto", torch.device("cpu"))
    assert precision.dtype in (torch.bfloat16, torch.float32) and variant.name in ("contract", "reference")


def test_the_python_snippets_of_ci_run_run() -> None:
    """`.ci/run` asks Python which CPU kind it is on to force the other's defaults; a module moved under it
    would fail CI after the suite passed (it did once: `native_bf16` moved to pipelines/precision.py)."""
    import re
    import shlex

    snippets = re.findall(r'python3 -c ("[^"]*")', (REPO / ".ci" / "run").read_text())
    assert snippets
    for snippet in snippets:
        code = shlex.split(snippet)[0]
        env = {k: v for k, v in os.environ.items() if k != CPU_DTYPE_ENV}  # as .ci/run's shell has it
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
        )
        assert result.returncode == 0 and result.stdout.strip() in ("fp32", "bf16"), result.stderr
