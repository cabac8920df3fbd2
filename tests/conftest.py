"""Test-wide setup: Triton runs under its CPU interpreter when there is no GPU; `gpu` tests skip cleanly.

Tests marked `interpreter` (Triton kernels on CPU tensors) or `browser` (Debian chromium through
Playwright) skip when their tool is missing, except under CI=true: there they fail with the reason, so
CI cannot pass without running them. Only the `gpu` tests skip in CI (no CUDA on a CPU runner).

OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE, unless set) in this process and in every process
a test starts: by default they spin, and the suite often runs two torch processes at once (eval workers,
ranks, servers): on 2 cores two spinning 2-thread processes ran a generation 9x slower than one alone.
How threads wait changes no result: the work is split the same way.

Which dtype the CPU default picks depends on the CPU (BF16 with AVX-512 BF16 or AMX, else FP32; pipelines'
`pick_precision`), so a test that loads a pipeline without a dtype is marked `cpu_dtype`: README's command
runs it with this CPU's default and `.ci/run` once more with the other one forced (`QWEN_IMAGE_CPU_DTYPE`),
so it passes on both CPU kinds. Every other test runs with `QWEN_IMAGE_CPU_DTYPE` set to a value the
pipeline refuses, in this process and in the processes it starts: a test that reads the CPU default
without the mark fails on any machine, naming the mark.

With `-n auto` (the README's test command) the tests run in two pytest-xdist workers without CUDA: a
module's tests stay on one worker, so its module fixtures are built once; the documented examples, each a
chain of processes, go one by one; modules with `slow` tests are handed out first. With CUDA `-n auto`
means one process: the GPU tests measure memory and time on a device they must have alone.
"""

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, as torch loads libgomp (imported below)

import pytest
import torch
from helpers import CHROMIUM

# Tests that xdist hands out one by one (not by module): they share no module fixture and take minutes.
ALONE = {"tests/test_docs_examples.py"}

if not torch.cuda.is_available():
    # Must be set before any kernel module is imported: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")


UNMARKED = "unset for tests not marked cpu_dtype (tests/conftest.py): mark the test"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_report_header(config: pytest.Config) -> str:
    """The thread count torch splits CPU work over (CI runs the `numerics` tests with 1 and with 2)."""
    return f"torch intra-op threads: {torch.get_num_threads()}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "interpreter: runs Triton kernels on CPU tensors (TRITON_INTERPRET=1)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """A test without the `cpu_dtype` mark cannot read the CPU's default dtype (setup, call, teardown and
    the processes it starts): the pipeline refuses the value it finds in `QWEN_IMAGE_CPU_DTYPE`."""
    # after TRITON_INTERPRET is set (kernels read it)
    from qwen_image_fusion.pipelines.precision import CPU_DTYPE_ENV

    saved = os.environ.get(CPU_DTYPE_ENV)
    if "cpu_dtype" not in item.keywords:
        os.environ[CPU_DTYPE_ENV] = UNMARKED
    try:
        return (yield)
    finally:
        if saved is None:
            os.environ.pop(CPU_DTYPE_ENV, None)
        else:
            os.environ[CPU_DTYPE_ENV] = saved


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two workers on a CPU (one process kept 1.2 of 2 cores busy: imports, servers and ranks
    are mostly one thread), none (this process) with CUDA."""
    return 0 if torch.cuda.is_available() else 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Work units for the xdist workers: a test module, or one test of ALONE; handed out in collection order
    (not xdist's largest-first), which a worker sorts in `pytest_collection_modifyitems`."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if module in ALONE else module

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # modules with slow tests first, so that no long one starts last while the other worker idles
        slow = {item.nodeid.split("::", 1)[0] for item in items if "slow" in item.keywords}
        items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def missing_tool(item: pytest.Item) -> str | None:
    """Why `item` cannot run its real check on this machine, or None."""
    if "interpreter" in item.keywords:
        from qwen_image_fusion.kernels._triton_common import interpreted
        from qwen_image_fusion.kernels.quant import _static_quant_fp8_kernel

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


@pytest.fixture(scope="session")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default quantized to FP8 (calibrated on two prompts, 2 steps at 32x32), shared by the
    FP8 tests of a worker; a module with another calibration defines its own `fp8_dir`."""
    from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("fp8") / "model"
    return quantize_checkpoint(None, out, prompts=["a red fox", "一只熊猫"], steps=2, size=32, device="cpu")


@pytest.fixture(scope="module", params=[("reference", "fp32"), ("contract", "bf16")], ids=lambda p: p[0])
def bytes_pipe(request: pytest.FixtureRequest):
    """The embedded default in both variants every CPU serves (`reference` in FP32, `contract` in BF16),
    run under one thread: CPU kernels may split sums by thread count, and byte comparisons need one."""
    from qwen_image_fusion.pipelines import load_pipeline

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_pipeline(variant=request.param[0], dtype=request.param[1])
    torch.set_num_threads(threads)
