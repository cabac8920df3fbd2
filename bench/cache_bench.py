"""Seconds per image with each step-cache preset against the exact run, on one checkpoint, in one process.

Runs: `off` (the exact path), `never` (the cache with a threshold of 0: every block runs, so its time over
`off` is the cache's own cost: the graph split, the host read of the decision, the residual copies), the
presets (`fast`, `faster`), and `always` (threshold infinite, at most `--in-a-row` skipped steps in a row:
the time of a fixed schedule, whatever the weights). Each configuration runs once for 3 steps to warm up
(every CUDA graph, both ways of each decision, is captured then) and `--runs` times timed; it reports
seconds per image, the steps skipped and PSNR against the exact image of the same seed. On random weights
the presets' decisions (and the PSNR) mean nothing for quality: quality is measured on the trained
embedded default (BENCHMARKS.md); the speed of a schedule is what this measures.

With `--gpu-memory` the pipeline is placed for that budget (transformer blocks streamed from host memory
where it is small; planned for a request with a step cache): a skipped step also leaves out the copies of
its skipped blocks.

    python bench/cache_bench.py --model DIR [--size 1024] [--steps 50] [--cfg 4] [--image] [--preset P]
        [--gpu-memory 16GiB]
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from qwen_image_fusion.eval import metrics
from qwen_image_fusion.models.cache_presets import CACHE_PRESETS, CachePreset
from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.pipelines import load_pipeline


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def caches(in_a_row: int, warmup: int) -> dict[str, CachePreset | None]:
    return {
        "off": None,
        "never": CachePreset("never", threshold=0.0),
        **CACHE_PRESETS,
        "always": CachePreset("always", math.inf, warmup_steps=warmup, max_cached_in_a_row=in_a_row),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--cfg", type=float, default=4.0, help="true CFG scale (1: off)")
    parser.add_argument("--preset", help="a sampling preset (e.g. lightning-8)")
    parser.add_argument("--image", action="store_true", help="edit one drawn input image of --size")
    parser.add_argument("--caches", default="off,never,fast,faster,always")
    parser.add_argument("--in-a-row", type=int, default=3, help="`always`: skipped steps in a row at most")
    parser.add_argument("--warmup", type=int, default=2, help="`always`: warm-up steps (all blocks run)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--gpu-memory", help="a GPU-memory budget to place the pipeline for (e.g. 16GiB)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    planned = dict(
        gpu_memory=args.gpu_memory,
        workload=Workload(args.size, args.size, input_images=int(args.image), step_cache=True),
    )
    pipe = load_pipeline(args.model or None, **(planned if args.gpu_memory else {}))
    request = dict(width=args.size, height=args.size, num_inference_steps=args.steps, preset=args.preset)
    request |= dict(negative_prompt=" ", true_cfg_scale=args.cfg)
    if args.image:
        pixels = np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
        request["image"] = PIL.Image.fromarray(pixels)
    prompt = "a red fox in the snow, detailed fur"
    known = caches(args.in_a_row, args.warmup)
    rows, exact = [], {}
    for name in args.caches.split(","):
        cache = known[name]
        pipe.generate(prompt, seed=100, cache=cache, **(request | {"num_inference_steps": 3}))  # captures
        seconds, skipped, quality = [], None, []
        for run in range(args.runs):
            sync()
            start = time.perf_counter()
            image = pipe.generate(prompt, seed=run, cache=cache, **request)[0]
            sync()
            seconds.append(time.perf_counter() - start)
            skipped = None if pipe.last_run.cache is None else pipe.last_run.cache.summary()
            if name == "off":
                exact[run] = image
            elif run in exact:
                quality.append(metrics.psnr(np.asarray(exact[run]), np.asarray(image)))
        row = {
            "cache": name,
            "describe": "" if cache is None else cache.describe(),
            "s_per_image": statistics.median(seconds),
            "denoising_s": pipe.last_run.timings["denoising"],
            "stages_s": pipe.last_run.timings,  # the last run's text encoding, denoising, decoding
            "steps": pipe.last_run.num_inference_steps,
            "skipped": skipped,
            "psnr_vs_exact_random_weights": min(quality) if quality else None,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model": args.model, "variant": pipe.variant, "size": args.size, "cfg": args.cfg}
    if pipe.memory is not None:
        result |= {"gpu_memory": args.gpu_memory, "plan": pipe.memory.describe()}
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    result |= {"preset": args.preset, "image": args.image, "runs": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
