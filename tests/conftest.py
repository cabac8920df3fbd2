"""Test-wide setup: Triton runs under its CPU interpreter when there is no GPU; `gpu` tests skip cleanly.

Tests marked `interpreter` (Triton kernels on CPU tensors) or `browser` (Debian chromium through
Playwright) skip when their tool is missing, except under CI=true: there they fail with the reason, so
CI cannot pass without running them. Only the `gpu` tests skip in CI (no CUDA on a CPU runner).
"""

import importlib.util
import os

import pytest
import torch
from helpers import CHROMIUM

if not torch.cuda.is_available():
    # Must be set before any kernel module is imported: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_report_header(config: pytest.Config) -> str:
    """The thread count torch splits CPU work over (CI runs the `numerics` tests with 1 and with 2)."""
    return f"torch intra-op threads: {torch.get_num_threads()}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "interpreter: runs Triton kernels on CPU tensors (TRITON_INTERPRET=1)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def missing_tool(item: pytest.Item) -> str | None:
    """Why `item` cannot run its real check on this machine, or None."""
    if "interpreter" in item.keywords:
        from kernels._triton_common import interpreted
        from kernels.quant import _static_quant_fp8_kernel

        if not interpreted(_static_quant_fp8_kernel):
            setting = os.environ.get("TRITON_INTERPRET")
            return f"Triton's CPU interpreter is off (TRITON_INTERPRET={setting!r}; it must be 1)"
    if "browser" in item.keywords:
        if not CHROMIUM.exists():
            return f"{CHROMIUM} not found (apt-get install chromium)"
        if importlib.util.find_spec("playwright") is None:
            return "playwright is not installed (pip install -e '.[test]')"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "interpreter" in item.keywords and torch.cuda.is_available():
        pytest.skip("runs the kernels on CPU tensors; with CUDA, tests/gpu checks the compiled kernels")
    reason = missing_tool(item)
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI=true: this test must run, but {reason}", pytrace=False)
    pytest.skip(reason)
