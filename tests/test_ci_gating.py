"""tests/conftest.py: a missing tool skips a test, except under CI=true, where the test fails with why."""

import types
from pathlib import Path

import conftest
import pytest
import torch

import kernels._triton_common as triton_common


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
