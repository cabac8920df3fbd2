"""img2img and inpainting on one GPU (issue 37 §6): a Qwen-Image FP8 checkpoint, 1024x1024 from a
1024x1024 start image, true CFG (negative " ", scale 4). In one run:

- ms per denoising step, ours (fp8-fused, CUDA graphs) against diffusers' `QwenImageImg2ImgPipeline` and
  `QwenImageInpaintPipeline` in BF16 with diffusers' transformer on the same weights (the FP8 ones
  dequantized; eager), timed alike: CUDA-synchronized timestamps after every step, the median gap;
- seconds per image end to end at 50 steps: text to image, img2img and inpainting at strength 0.6 (30 of
  the 50 steps run), each with its peak of allocated GPU memory.

    python bench/make_random_checkpoint.py --out /tmp/qwen-image-random-fp8            # once
    python bench/start_bench.py --model /tmp/qwen-image-random-fp8 --out start_bench.json  # H200
"""

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from edit_bench import diffusers_transformer, step_gaps
from PIL import Image

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.pipeline import Pipeline

PROMPT = "a red fox in the snow, detailed fur, golden hour"


def start_images(size: int) -> tuple[Image.Image, Image.Image]:
    """A smooth scene with grain and the mask of an off-centre ellipse (white: repainted)."""
    y, x = np.mgrid[0:size, 0:size] / size
    scene = np.stack([90 + 120 * y, 140 + 60 * x, 230 - 80 * y], axis=-1)
    scene += np.random.default_rng(0).normal(0, 10, scene.shape)
    ellipse = ((x - 0.4) / 0.3) ** 2 + ((y - 0.55) / 0.35) ** 2 < 1
    image = Image.fromarray(np.clip(scene, 0, 255).astype(np.uint8), "RGB")
    return image, Image.fromarray((255 * ellipse).astype(np.uint8), "L")


def ours_per_step(pipe: Pipeline, steps: int, **kwargs) -> list[float]:
    """Our step gaps after a warm-up with the same shapes (graph capture, autotuning)."""
    pipe.generate(PROMPT, num_inference_steps=steps, seed=0, **kwargs)
    return step_gaps(lambda tick: pipe.generate(PROMPT, num_inference_steps=steps, seed=1,
                                                on_step=lambda i, n: tick(), **kwargs))  # fmt: skip


def diffusers_per_step(theirs: object, steps: int, **kwargs) -> list[float]:
    """diffusers' step gaps after a warm-up run, same request as ours (latents out unless `kwargs` says)."""

    def run(tick: Callable[[], None]) -> None:
        def on_step(_pipe, _i, _t, _kwargs) -> dict:
            tick()
            return {}

        with torch.no_grad():
            generator = torch.Generator("cpu").manual_seed(1)
            theirs(prompt=PROMPT, num_inference_steps=steps, generator=generator,
                   callback_on_step_end=on_step, **{"output_type": "latent"} | kwargs)  # fmt: skip

    run(lambda: None)
    return step_gaps(run)


def per_image(pipe: Pipeline, runs: int, **kwargs) -> dict[str, float]:
    """Median seconds end to end over `runs` after a warm-up, ms per step and the peak allocated GiB."""
    pipe.generate(PROMPT, seed=0, **kwargs)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    totals = []
    for i in range(runs):
        pipe.generate(PROMPT, seed=i + 1, **kwargs)
        totals.append(pipe.last_run.timings["total"])
    run = pipe.last_run
    return {
        "seconds": statistics.median(totals),
        "steps_run": run.num_inference_steps,
        "ms_per_step": run.ms_per_step,
        "timings": dict(run.timings),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
    }


def exactness(pipe: Pipeline, **request) -> dict[str, bool]:
    """fused == unfused and graphs == eager on the final latents of a short run of `request` (3 steps, true
    CFG with negative " ", unless it says otherwise)."""
    args = dict(num_inference_steps=3, negative_prompt=" ", true_cfg_scale=4.0, seed=5, output_type="latent")
    runs = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        for graphs in (True, False):
            pipe.cuda_graphs = graphs
            runs[variant, graphs] = pipe.generate(PROMPT, **args | request)
    pipe.set_variant("fp8-fused")
    pipe.cuda_graphs = True
    reference = runs["fp8-fused", True]
    return {
        "fused_equals_unfused": torch.equal(reference, runs["fp8-unfused", True]),
        "graphs_equal_eager": torch.equal(reference, runs["fp8-fused", False])
        and torch.equal(runs["fp8-unfused", True], runs["fp8-unfused", False]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="FP8 Qwen-Image checkpoint (default: the embedded one, a smoke run)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="steps of each per-step timing run")
    parser.add_argument("--full-steps", type=int, default=50)
    parser.add_argument("--strength", type=float, default=0.6)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    pipe = load_pipeline(args.model, dtype="bf16")
    image, mask = start_images(args.size)
    common = dict(width=args.size, height=args.size, negative_prompt=" ", true_cfg_scale=4.0)
    kinds = {
        "text_to_image": {},
        "img2img": dict(init_image=image, strength=args.strength),
        "inpaint": dict(init_image=image, mask_image=mask, strength=args.strength),
    }
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {"model": args.model, "device": device, "size": args.size}
    result |= {"variant": pipe.variant, "fusion": pipe.fusion_summary().splitlines()[0]}
    result["per_image"] = {
        kind: per_image(pipe, args.runs, num_inference_steps=args.full_steps, **common, **extra)
        for kind, extra in kinds.items()
    }
    for kind, row in result["per_image"].items():
        peak = row["peak_allocated_gib"]
        print(f"{kind}: {row['seconds']:.2f} s ({row['steps_run']} steps), peak {peak:.1f} GiB", flush=True)
    ours = {kind: ours_per_step(pipe, args.steps, **common, **(extra | {"strength": 1.0} if extra else {}))
            for kind, extra in kinds.items() if extra}  # fmt: skip
    from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline

    c = pipe.components
    transformer = diffusers_transformer(pipe)
    parts = dict(vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer, transformer=transformer)
    classes = {"img2img": QwenImageImg2ImgPipeline, "inpaint": QwenImageInpaintPipeline}
    theirs = {}
    for kind, cls in classes.items():
        diffusers = cls(scheduler=copy.deepcopy(c.scheduler), **parts)
        diffusers.set_progress_bar_config(disable=True)
        extra = {"image": image, "strength": 1.0} | ({"mask_image": mask} if kind == "inpaint" else {})
        theirs[kind] = diffusers_per_step(diffusers, args.steps, **common, **extra)
    result["per_step_ms"] = {}
    for kind in classes:
        mine, other = statistics.median(ours[kind]), statistics.median(theirs[kind])
        ratio = other / mine
        result["per_step_ms"][kind] = {"ours_fp8_fused_graph": mine, "diffusers_bf16": other,
                                       "speedup": ratio, "ours_gaps": ours[kind],
                                       "diffusers_gaps": theirs[kind]}  # fmt: skip
        print(
            f"{kind} ms/step with CFG: ours {mine:.1f}, diffusers {other:.1f} ({ratio:.2f}x)",
            flush=True,
        )
    result["total_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} in {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
