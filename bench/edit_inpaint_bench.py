"""Inpainting edits on one GPU (issue 37 §6): a full-size random FP8 one-image Edit checkpoint
(`QwenImageEditPipeline`, Qwen2.5-VL-7B's vision tower), a 1024x1024 scene and the mask of an off-centre
ellipse, strength 0.6 (30 of 50 steps run), true CFG (negative " ", scale 4). In one run:

- fp8-fused == fp8-unfused at full size (final latents compared with `torch.equal`), and CUDA-graph
  replays == eager;
- seconds per image end to end at 50 steps: an edit, and the inpainting edit, each with its peak memory;
- ms per denoising step with CFG, ours (fp8-fused, CUDA graphs) against diffusers'
  `QwenImageEditInpaintPipeline` in BF16 with diffusers' transformer on the same weights (the FP8 ones
  dequantized; eager), timed alike: CUDA-synchronized timestamps after every step, the median gap.

    python bench/make_random_checkpoint.py --edit --edit-single --out /tmp/qwen-image-edit1-random-fp8
    python bench/edit_inpaint_bench.py --model /tmp/qwen-image-edit1-random-fp8 --out edit_inpaint_bench.json
"""

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from edit_bench import diffusers_transformer
from start_bench import diffusers_per_step, exactness, ours_per_step, per_image, start_images

from qwen_image_fusion.pipelines import load_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="FP8 QwenImageEditPipeline checkpoint")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="steps of each per-step timing run")
    parser.add_argument("--full-steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    pipe = load_pipeline(args.model, dtype="bf16")
    scene, mask = start_images(args.size)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {"model": args.model, "device": device, "size": args.size, "variant": pipe.variant}
    result["fusion"] = pipe.fusion_summary().splitlines()
    inpaint = dict(image=scene, mask_image=mask, strength=0.6)
    result["exact"] = exactness(pipe, num_inference_steps=5, **inpaint)
    print(f"exactness at {args.size}x{args.size}: {result['exact']}", flush=True)
    common = dict(negative_prompt=" ", true_cfg_scale=4.0)
    kinds = {"edit": dict(image=scene), "inpainting_edit": inpaint}
    result["per_image"] = {
        kind: per_image(pipe, args.runs, num_inference_steps=args.full_steps, **common, **extra)
        for kind, extra in kinds.items()
    }
    for kind, row in result["per_image"].items():
        peak = row["peak_allocated_gib"]
        print(f"{kind}: {row['seconds']:.2f} s ({row['steps_run']} steps), peak {peak:.1f} GiB", flush=True)
    steps = round(args.steps / 0.6)  # strength 0.6: this many asked for runs `args.steps`
    mine = ours_per_step(pipe, steps, **common, **inpaint)
    from diffusers import QwenImageEditInpaintPipeline

    c = pipe.components
    theirs = QwenImageEditInpaintPipeline(
        scheduler=copy.deepcopy(c.scheduler), vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
        processor=c.processor, transformer=diffusers_transformer(pipe),
    )  # fmt: skip
    theirs.set_progress_bar_config(disable=True)
    other = diffusers_per_step(theirs, steps, **common, **inpaint)
    ours_ms, their_ms = statistics.median(mine), statistics.median(other)
    result["per_step_ms"] = {
        "ours_fp8_fused_graph": ours_ms,
        "diffusers_bf16": their_ms,
        "speedup": their_ms / ours_ms,
        "ours_gaps": mine,
        "diffusers_gaps": other,
    }
    print(f"inpainting edit, ms/step with CFG: ours {ours_ms:.1f}, diffusers {their_ms:.1f} "
          f"({their_ms / ours_ms:.2f}x)", flush=True)  # fmt: skip
    result["total_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
