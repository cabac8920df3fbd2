"""Wall-clock seconds of whole commands on this machine, with what decides them (CPU model and flags, torch's
CPU capability, the dtype the CPU default picks), for the CPU figures the README and BENCHMARKS.md give.

Each command runs --runs times, one after another, in a fresh temporary folder (so an output path it writes
does not exist yet); the JSON keeps every run's seconds and the median.

    python bench/cpu_timings.py --out bench/results/DIR/cpu_timings.json \
        --command "first: qwen-image generate 'a red circle on the left' --seed 0 -o first.png" \
        --command "quantize: qwen-image quantize --out fp8-default"
"""

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qwen_image_fusion.pipelines.precision import cpu_dtype_override, native_bf16


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def machine() -> dict:
    """The CPU and what the project picks on it."""
    flags = Path("/proc/cpuinfo").read_text()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_tile": "amx_tile" in flags,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "default_dtype_native_bf16": native_bf16(torch.device("cpu")),
        "QWEN_IMAGE_CPU_DTYPE": cpu_dtype_override(),
        "load_average_before": os.getloadavg(),
    }


def run(name: str, command: str, runs: int) -> dict:
    """`command` (`qwen-image` meaning this checkout's CLI) timed `runs` times."""
    argv = shlex.split(command)
    if argv[0] == "qwen-image":
        argv = [sys.executable, "-m", "qwen_image_fusion.ui.cli", *argv[1:]]
    seconds = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as folder:
            env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
            start = time.perf_counter()
            result = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, check=False)
            seconds.append(time.perf_counter() - start)
        if result.returncode:
            raise SystemExit(f"{name}: exit {result.returncode}\n{result.stderr[-2000:]}")
        print(f"{name}: {seconds[-1]:.2f} s", flush=True)
    return {
        "command": command,
        "seconds": seconds,
        "median_s": statistics.median(seconds),
        "stdout": result.stdout,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--command", action="append", required=True, help="NAME: COMMAND (repeatable)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"machine": machine(), "runs": args.runs, "commands": {}}
    for spec in args.command:
        name, command = spec.split(":", 1)
        result["commands"][name.strip()] = run(name.strip(), command.strip(), args.runs)
    result["machine"]["load_average_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
