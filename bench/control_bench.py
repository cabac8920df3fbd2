"""ControlNet on one GPU (issue 37 §6): a full-size random FP8 QwenImageControlNetPipeline checkpoint (the
60-block DiT and a 5-block ControlNet, as InstantX's Union), 1024x1024, true CFG (negative " ", scale 4).
In one run:

- fp8-fused == fp8-unfused at full size (two control maps, 3 steps, final latents compared with
  `torch.equal`), and CUDA-graph replays == eager;
- seconds per image end to end at 50 steps: text to image (the ControlNet idle), one control map, two maps,
  each with its peak of allocated GPU memory;
- ms per denoising step with CFG and one map, ours (fp8-fused, CUDA graphs) against diffusers'
  `QwenImageControlNetPipeline` in BF16 with diffusers' transformer and ControlNet on the same weights (the
  FP8 ones dequantized; eager), timed alike: CUDA-synchronized timestamps after every step, the median gap.

    python bench/make_random_checkpoint.py --out /tmp/qwen-image-controlnet-random-fp8 --controlnet 5
    python bench/control_bench.py --model /tmp/qwen-image-controlnet-random-fp8 --out control_bench.json

On an inpainting ControlNet checkpoint (`--controlnet 5 --inpaint`) each request with control gives the
scene and the mask of an off-centre ellipse instead (`QwenImageControlNetInpaintPipeline`; one image).
"""

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from edit_bench import diffusers_copy, diffusers_transformer
from PIL import Image
from start_bench import diffusers_per_step, exactness, ours_per_step, per_image

from qwen_image_fusion.pipelines import load_pipeline


def control_maps(size: int) -> tuple[Image.Image, Image.Image]:
    """An edge map (the outlines of a disc and a bar, white on black, like a canny map) and a depth-like grey
    ramp with a nearer disc."""
    y, x = np.mgrid[0:size, 0:size] / size
    shapes = ((x - 0.6) ** 2 + (y - 0.4) ** 2 < 0.04) | ((abs(x - 0.25) < 0.05) & (y > 0.3))
    outline = shapes ^ np.roll(shapes, 1, axis=0) | shapes ^ np.roll(shapes, 1, axis=1)
    edges = Image.fromarray((255 * outline).astype(np.uint8)).convert("RGB")
    depth = np.where((x - 0.35) ** 2 + (y - 0.5) ** 2 < 0.05, 230, 60 + 120 * y).astype(np.uint8)
    return edges, Image.fromarray(depth).convert("RGB")


def ellipse(size: int) -> Image.Image:
    """The mask of an off-centre ellipse (white: repainted)."""
    y, x = np.mgrid[0:size, 0:size] / size
    return Image.fromarray((255 * (((x - 0.4) / 0.3) ** 2 + ((y - 0.55) / 0.35) ** 2 < 1)).astype(np.uint8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="FP8 QwenImageControlNetPipeline checkpoint")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="steps of each per-step timing run")
    parser.add_argument("--full-steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    pipe = load_pipeline(args.model, dtype="bf16")
    edges, depth = control_maps(args.size)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {"model": args.model, "device": device, "size": args.size, "variant": pipe.variant}
    result["fusion"] = pipe.fusion_summary().splitlines()
    inpaints = pipe.spec.control_inpaints
    kinds = {
        "text_to_image": {},
        "one_map": dict(control_image=edges, controlnet_conditioning_scale=0.8),
        "two_maps": dict(control_image=[edges, depth], controlnet_conditioning_scale=[0.8, 0.5]),
    }
    if inpaints:
        scene = Image.fromarray(np.asarray(depth)[..., ::-1].copy())  # any RGB image to repaint a part of
        kinds = {"text_to_image": {}, "inpaint": dict(control_image=scene, control_mask=ellipse(args.size))}
    exact_request = kinds["inpaint" if inpaints else "two_maps"]
    result["exact"] = exactness(pipe, width=args.size, height=args.size, **exact_request)
    print(f"exactness at {args.size}x{args.size}: {result['exact']}", flush=True)
    common = dict(width=args.size, height=args.size, negative_prompt=" ", true_cfg_scale=4.0)
    result["per_image"] = {
        kind: per_image(pipe, args.runs, num_inference_steps=args.full_steps, **common, **extra)
        for kind, extra in kinds.items()
    }
    for kind, row in result["per_image"].items():
        peak = row["peak_allocated_gib"]
        print(f"{kind}: {row['seconds']:.2f} s ({row['steps_run']} steps), peak {peak:.1f} GiB", flush=True)
    one = kinds["inpaint" if inpaints else "one_map"]
    mine = ours_per_step(pipe, args.steps, **common, **one)
    from diffusers import (
        QwenImageControlNetInpaintPipeline,
        QwenImageControlNetModel,
        QwenImageControlNetPipeline,
    )

    c = pipe.components
    cls = QwenImageControlNetInpaintPipeline if inpaints else QwenImageControlNetPipeline
    theirs = cls(
        scheduler=copy.deepcopy(c.scheduler),
        vae=c.vae,
        text_encoder=c.text_encoder,
        tokenizer=c.tokenizer,
        transformer=diffusers_transformer(pipe),
        controlnet=diffusers_copy(c.controlnet, QwenImageControlNetModel),
    )
    theirs.set_progress_bar_config(disable=True)
    other = diffusers_per_step(theirs, args.steps, **common, **one)
    ours_ms, their_ms = statistics.median(mine), statistics.median(other)
    result["per_step_ms"] = {
        "ours_fp8_fused_graph": ours_ms,
        "diffusers_bf16": their_ms,
        "speedup": their_ms / ours_ms,
        "ours_gaps": mine,
        "diffusers_gaps": other,
    }
    kind = "inpaint" if inpaints else "one map"
    print(
        f"{kind}, ms/step with CFG: ours {ours_ms:.1f}, diffusers {their_ms:.1f} ({their_ms / ours_ms:.2f}x)",
        flush=True,
    )
    result["total_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} in {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
