"""What an HTTP response costs beyond `generate()` on this CPU, for one 1024x1024 noise image (noise, as the
random full-size checkpoints decode, is what deflate cannot shrink: the worst case): writing the PNG as the
server does (`ui/image_cache.png_bytes`), its base64 by the standard library and by pybase64 (what the
server uses), and the JSON body by pydantic-core and by `json.dumps`. The median and the fastest of
`--repeats` timed calls after one warm-up (on a shared machine the fastest is the least disturbed), with the
machine (CPU model, cores, ISA flags, load average) written beside them.

    python -m bench.response_costs --out bench/results/DATE-cpu-claims/response_costs.json
"""

import argparse
import base64
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pybase64
import pydantic_core

from qwen_image_fusion.ui.image_cache import png_bytes

SIDE = 1024


def timed_ms(call: Callable[[], Any], repeats: int) -> dict[str, float]:
    """The median and the least wall time of `call` in milliseconds over `repeats` calls, after one untimed
    call."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return {"median": statistics.median(times), "min": min(times)}


def machine() -> dict[str, Any]:
    """The CPU as /proc/cpuinfo names it, its core count and the ISA flags that set the CPU default dtype."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return {
        "cpu": names[0] if names else platform.processor(),
        "cores": os.cpu_count(),
        "flags": [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if flag in flags],
        "python": platform.python_version(),
        "pybase64": pybase64.__version__,
        "pydantic_core": pydantic_core.__version__,
        "numpy": np.__version__,
    }


def measure(repeats: int) -> dict[str, Any]:
    pixels = np.random.default_rng(0).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    image = PIL.Image.fromarray(pixels, "RGB")
    png = png_bytes(image)
    text = pybase64.b64encode_as_string(png)
    assert text == base64.b64encode(png).decode()  # the two encoders write the same text
    body = {"created": 0, "data": [{"b64_json": text}]}
    return {
        "image": f"{SIDE}x{SIDE} RGB uniform noise, numpy seed 0",
        "png_bytes": len(png),
        "repeats": repeats,
        "ms": {
            "png_write": timed_ms(lambda: png_bytes(image), repeats),
            "base64_stdlib": timed_ms(lambda: base64.b64encode(png).decode(), repeats),
            "base64_pybase64": timed_ms(lambda: pybase64.b64encode_as_string(png), repeats),
            "json_pydantic_core": timed_ms(lambda: pydantic_core.to_json(body), repeats),
            "json_dumps": timed_ms(lambda: json.dumps(body).encode(), repeats),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    before = os.getloadavg()
    result = {"machine": machine(), "load_average_before": before, **measure(args.repeats)}
    result["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ms"], indent=2))


if __name__ == "__main__":
    main()
