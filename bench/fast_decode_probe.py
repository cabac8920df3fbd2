"""Whether the fast decode's 2D form runs on the embedded default on this CPU, and what it changes.

A fast-decode image equal to the exact one could mean the 2D form never ran (`decode_frames` falls back to
the exact decode with a log line). This counts the calls of `models.vae_decode.last_tap_forward` during a
`fast_decode=True` request and compares the pixels with the exact decode of the same latents, per dtype.

    python -m bench.fast_decode_probe --out bench/results/2026-12-05-cpu-quality/fast_decode_probe.json
"""

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

import qwen_image_fusion.models.vae_decode as vae_decode
from bench.quality_table import machine_record
from qwen_image_fusion.pipelines import load_pipeline

PROMPT = "A red apple on a wooden table, soft window light"
RUNS = (("contract", "bf16"), ("reference", "fp32"))  # this CPU's default; a CPU without native BF16's


def counting(calls: list[int], forward: Callable) -> Callable:
    """`forward` that counts its calls in calls[0]."""

    def wrapped(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return forward(*args, **kwargs)

    return wrapped


def probe(variant: str, dtype: str, steps: int) -> dict:
    """One exact and one fast-decode image of the same request: 2D-form calls, RunInfo, pixel changes."""
    pipe = load_pipeline(None, variant=variant, device="cpu", dtype=dtype)
    request = {"width": 256, "height": 256, "num_inference_steps": steps, "seed": 0}
    exact = np.asarray(pipe.generate(PROMPT, **request)[0], dtype=np.int16)
    calls = [0]
    original = vae_decode.last_tap_forward
    vae_decode.last_tap_forward = counting(calls, original)
    try:
        fast = np.asarray(pipe.generate(PROMPT, fast_decode=True, **request)[0], dtype=np.int16)
    finally:
        vae_decode.last_tap_forward = original
    diff = np.abs(exact - fast)
    return {
        "variant": variant,
        "dtype": dtype,
        "steps": steps,
        "last_tap_calls": calls[0],
        "run_info_decode": asdict(pipe.last_run.decode),
        "identical": bool((diff == 0).all()),
        "max_abs_diff": int(diff.max()),
        "levels_moved": float((diff > 0).mean()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fast_decode_probe", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, help="JSON file (default: print only)")
    args = parser.parse_args(argv)
    rows = []
    for variant, dtype in RUNS:
        rows.append(probe(variant, dtype, args.steps))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    command = ["python", "-m", "bench.fast_decode_probe", *(sys.argv[1:] if argv is None else argv)]
    result = {"command": command, "machine": machine_record().splitlines(), "prompt": PROMPT}
    if args.out:
        args.out.write_text(json.dumps({**result, "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
