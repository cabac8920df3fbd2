"""Compile recorded Triton launches for sm_90 without a GPU: binary keys and PTX instruction counts.

Used by the kernel tests to prove, on a CPU machine, that fused and unfused launches share one binary
and that the PTX follows the DESIGN §4 contract (no FMA, IEEE division and sqrt, no ftz).
Relies on Triton internals (checked on triton 3.6 and 3.7).
"""

import json
import os
import re
import subprocess
import sys

from helpers import REPO

PTX_PATTERNS = {
    "fma": r"\bfma\.rn\.f32",
    "div_rn": r"\bdiv\.rn\.f32",
    "div_inexact": r"\bdiv\.(full|approx)",
    "sqrt_rn": r"\bsqrt\.rn\.f32",
    "inexact_sqrt_or_rcp": r"\b(rsqrt|sqrt\.approx|rcp\.approx)",
    "rcp_approx": r"\brcp\.approx",
    "ex2_approx": r"\bex2\.approx",
    "tanh_approx": r"\btanh\.approx",
    "ftz": r"\.ftz\b",
    "min_max_nan": r"\b(min|max)\.NaN",
    "min_max_plain": r"\b(min|max)\.(xorsign\.abs\.)?f32",
    "cvt_e4m3": r"\bcvt\.rn\.satfinite\.e4m3x2\.f32",
    "cvt_bf16": r"\bcvt\.rn\.bf16(x2)?\.f32",
}


def record_launches(kernel) -> list[tuple[tuple, dict]]:
    """Make `kernel[grid](...)` record its (args, kwargs) instead of running; returns the record list."""
    calls: list[tuple[tuple, dict]] = []
    kernel.run = lambda *args, grid, warmup, **kwargs: calls.append((args, kwargs))
    return calls


def _backend():
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    return target, make_backend(target)


def _bind(kernel, args: tuple, kwargs: dict):
    from triton.runtime.jit import create_function_from_signature

    _, backend = _backend()
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    return binder(*args, **kwargs)


def binary_key(kernel, args: tuple, kwargs: dict) -> str:
    """Triton's cache key for this launch: equal keys mean one compiled binary."""
    from triton.runtime.jit import compute_cache_key

    _, spec, options = _bind(kernel, args, kwargs)
    return compute_cache_key({}, spec, options)


def sm90_ptx(kernel, args: tuple, kwargs: dict) -> str:
    """The PTX Triton compiles for this launch on sm_90."""
    import triton
    from triton.compiler.compiler import ASTSource

    target, backend = _backend()
    bound, spec, options = _bind(kernel, args, kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target, options.__dict__).asm[
        "ptx"
    ]


def ptx_counts(kernel, args: tuple, kwargs: dict) -> dict[str, int]:
    """Instruction counts of the launch as made, plus the FMA count had fp fusion been allowed (a probe
    that proves the FMA pattern can see contraction)."""
    code = sm90_ptx(kernel, args, kwargs)
    counts = {name: len(re.findall(pattern, code)) for name, pattern in PTX_PATTERNS.items()}
    probe = sm90_ptx(kernel, args, {**kwargs, "enable_fp_fusion": True})
    counts["fma_if_fusion_allowed"] = len(re.findall(PTX_PATTERNS["fma"], probe))
    return counts


def report_from_subprocess(script: str) -> dict:
    """Run `script` (a test module whose __main__ prints a JSON report) with Triton compiling, not
    interpreting, and no GPU visible, importing this checkout's kernels; returns the report."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode:
        raise AssertionError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])
