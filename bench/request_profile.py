"""Where one request's GPU time goes, by phase and by kernel kind (issue 36: Lightning-4, 2.1 Turbo-8).

    python bench/request_profile.py --model DIR --preset lightning-4 --out DIR [--size 1024] [--steps N]
        [--fast-decode]

Runs the request once to warm up (CUDA graphs captured, Triton compiled) and once plainly for its stage
timings (RunInfo: text encoding, denoising, decoding), then each phase under the CUDA profiler: the text
encoding alone (`Pipeline.encode`), the request to latents (`Pipeline.run(..., output_type="latent")`,
whose denoising is that minus the text encoding) and the VAE decoding of those latents. Kernels are
grouped by bench/profile_step.py's kinds. With `fast_decode` also the opt-in 2D decode of the same latents
(its kernels, and how far its pixels are from the exact decode's) and a plain run with it. Writes
DIR/request_profile_<name>.{json,md};
bench/qi21_bench.py --profile calls `profile_request` on its in-memory Qwen-Image 2.1 pipeline.
"""

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from profile_step import kind_of
from torch.profiler import ProfilerActivity, profile

from qwen_image_fusion.eval.metrics import abs_diff, psnr
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.pipeline import Pipeline

PROMPT = "a red fox in the snow, detailed fur"


def kernel_ms(run: Callable[[], Any]) -> tuple[Any, float, dict[str, float]]:
    """`run()`'s result, its wall milliseconds and its kernel milliseconds by kind, under the profiler."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        result = run()
        end.record()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            kind = kind_of(event.key)
            kinds[kind] = kinds.get(kind, 0.0) + event.device_time_total / 1000
    return result, start.elapsed_time(end), kinds


@torch.no_grad()
def profile_request(
    pipe: Pipeline, name: str, out: Path, fast_decode: bool = False, **values: Any
) -> dict[str, Any]:
    """The phase and kernel-kind report of `pipe.generate(PROMPT, **values)`, written under `out`."""
    request = pipe.request(PROMPT, **values)
    pipe.run([request])  # warm-up: graphs and kernels at this shape
    pipe.run([request])
    stages = dict(pipe.last_run.timings)
    _, text_ms, text = kernel_ms(lambda: pipe.encode(list(request.prompts), request.max_sequence_length))
    generated, latent_ms, to_latents = kernel_ms(lambda: pipe.run([request], output_type="latent"))
    canvas = pipe.model.canvas(request.width, request.height, list(request.images), len(request.prompts))
    exact, decode_ms, decode = kernel_ms(lambda: pipe.model.decode(generated[0].images, canvas).images)
    denoise = {k: to_latents[k] - text.get(k, 0.0) for k in to_latents}
    report = {
        "name": name,
        "model": pipe.model_name,
        "variant": pipe.variant,
        "request": {k: str(v) for k, v in values.items()},
        "steps": request.num_inference_steps,
        "stages_s": stages,
        "profiled_wall_ms": {"text": text_ms, "to_latents": latent_ms, "decode": decode_ms},
        "kernel_ms": {"text": text, "denoise": denoise, "decode": decode},
    }
    if fast_decode:
        latents = generated[0].images
        fast, fast_ms, kinds = kernel_ms(lambda: pipe.model.decode(latents, canvas, True).images)
        pipe.run([replace(request, fast_decode=True)])
        report["fast_decode"] = {
            "profiled_wall_ms": fast_ms,
            "kernel_ms": kinds,
            "stages_s": dict(pipe.last_run.timings),
            "versus_exact": level_difference(exact, fast),
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"request_profile_{name}.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / f"request_profile_{name}.md").write_text(table + "\n")
    return report


def level_difference(exact: list[PIL.Image.Image], other: list[PIL.Image.Image]) -> dict[str, float]:
    """How far `other`'s 8-bit levels are from `exact`'s: the largest step, the share moved, PSNR (dB)."""
    a, b = (np.stack([np.asarray(image) for image in images]) for images in (exact, other))
    diff = abs_diff(a, b)
    return {
        "max_level_diff": int(diff.max()),
        "levels_moved": float(np.mean(diff > 0)),
        "psnr_db": psnr(a, b),
    }


def markdown(report: dict[str, Any]) -> str:
    """Kernel milliseconds by phase and kind, with each phase's kernel total and plain-run stage time."""
    phases = report["kernel_ms"]
    kinds = sorted(
        {k for p in phases.values() for k in p}, key=lambda k: -sum(p.get(k, 0) for p in phases.values())
    )
    stage = {"text": "text_encoding", "denoise": "denoising", "decode": "decoding"}
    lines = [
        f"# {report['name']}: {report['model']} ({report['variant']}), {report['steps']} steps,"
        f" {report['request']}",
        "",
        "| kind | " + " | ".join(f"{p} ms" for p in phases) + " |",
        "|---|" + "---:|" * len(phases),
        *(f"| {k} | " + " | ".join(f"{phases[p].get(k, 0.0):.2f}" for p in phases) + " |" for k in kinds),
        "| **kernels** | " + " | ".join(f"**{sum(v.values()):.1f}**" for v in phases.values()) + " |",
        "| plain run's stage | "
        + " | ".join(f"{1000 * report['stages_s'].get(stage[p], float('nan')):.1f}" for p in phases)
        + " |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--preset", help="a sampling preset, e.g. lightning-4")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--cfg", type=float, default=1.0, help="true CFG scale (1: off)")
    parser.add_argument("--fast-decode", action="store_true", help="also the opt-in 2D decode, compared")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pipe = load_pipeline(args.model)
    values = {"width": args.size, "height": args.size, "true_cfg_scale": args.cfg, "seed": 0}
    values |= {"preset": args.preset} if args.preset else {}
    values |= {"num_inference_steps": args.steps} if args.steps else {}
    name = f"{args.preset or f'{args.steps}-steps'}_{args.size}"
    report = profile_request(pipe, name, args.out, args.fast_decode, **values)
    print(markdown(report))
    if args.fast_decode:
        print("fast decode:", json.dumps(report["fast_decode"]))


if __name__ == "__main__":
    main()
