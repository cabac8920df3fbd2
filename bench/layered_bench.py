"""Qwen-Image-Layered on one GPU (issue 37 §6): a full-size random FP8 QwenImageLayeredPipeline checkpoint
(the 60-block DiT with the layer-3D RoPE and task embedding, the RGBA VAE), an RGBA image decomposed into 4
layers at diffusers' 640 bucket, true CFG (negative " ", scale 4). In one run:

- fp8-fused == fp8-unfused at full size (3 steps, final latents compared with `torch.equal`), and CUDA-graph
  replays == eager;
- seconds per decomposition end to end at 50 steps, with its peak of allocated GPU memory;
- ms per denoising step with CFG, ours (fp8-fused, CUDA graphs) against diffusers' `QwenImageLayeredPipeline`
  in BF16 with diffusers' transformer on the same weights (the FP8 ones dequantized; eager), timed alike:
  CUDA-synchronized timestamps after every step, the median gap; then ours alone at the 1024 bucket.

    python bench/make_random_checkpoint.py --out /tmp/qwen-image-layered-random-fp8 --layered
    python bench/layered_bench.py --model /tmp/qwen-image-layered-random-fp8 --out layered_bench.json
"""

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from edit_bench import diffusers_transformer
from PIL import Image
from start_bench import diffusers_per_step, exactness, ours_per_step, per_image

from qwen_image_fusion.pipelines import load_pipeline


def rgba_scene(width: int, height: int) -> Image.Image:
    """A scene with a translucent disc over a ramp: an image with something to separate into layers."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    rgb = np.stack([90 + 120 * y, 140 + 60 * x, 230 - 80 * y], axis=-1)
    disc = (x - 0.5) ** 2 + (y - 0.4) ** 2 < 0.05
    rgb[disc] = (220, 60, 40)
    alpha = np.where(disc, 200, 255)[..., None]
    return Image.fromarray(np.concatenate([rgb, alpha], axis=-1).astype(np.uint8), "RGBA")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="FP8 QwenImageLayeredPipeline checkpoint")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps of each per-step timing run")
    parser.add_argument("--full-steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    pipe = load_pipeline(args.model, dtype="bf16")
    image = rgba_scene(800, 800)  # square: the 640 bucket is 640x640
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {"model": args.model, "device": device, "layers": args.layers, "variant": pipe.variant}
    result["fusion"] = pipe.fusion_summary().splitlines()
    common = dict(image=image, layers=args.layers, negative_prompt=" ", true_cfg_scale=4.0)
    request = pipe.request("x", resolution=640, **common)
    result["size"] = [request.width, request.height]
    sized = dict(common, width=request.width, height=request.height)
    size = dict(width=request.width, height=request.height)
    result["exact"] = exactness(pipe, image=image, layers=args.layers, **size)
    print(f"exactness at {request.width}x{request.height}: {result['exact']}", flush=True)
    row = per_image(pipe, args.runs, num_inference_steps=args.full_steps, **sized)
    result["per_image"] = row
    print(f"{args.layers} layers at {request.width}x{request.height}: {row['seconds']:.2f} s "
          f"({row['steps_run']} steps), peak {row['peak_allocated_gib']:.1f} GiB", flush=True)  # fmt: skip
    mine = ours_per_step(pipe, args.steps, **sized)
    from diffusers import QwenImageLayeredPipeline

    c = pipe.components
    theirs = QwenImageLayeredPipeline(
        scheduler=copy.deepcopy(c.scheduler), vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
        processor=c.processor, transformer=diffusers_transformer(pipe),
    )  # fmt: skip
    theirs.set_progress_bar_config(disable=True)
    # output_type "np": diffusers' Layered pipeline fails on "latent" (its `images` is never set then)
    other = diffusers_per_step(theirs, args.steps, resolution=640, output_type="np", **common)
    ours_ms, their_ms = statistics.median(mine), statistics.median(other)
    result["per_step_ms"] = {
        "ours_fp8_fused_graph": ours_ms,
        "diffusers_bf16": their_ms,
        "speedup": their_ms / ours_ms,
        "ours_gaps": mine,
        "diffusers_gaps": other,
    }
    print(f"640 bucket, ms/step with CFG: ours {ours_ms:.1f}, diffusers {their_ms:.1f} "
          f"({their_ms / ours_ms:.2f}x)", flush=True)  # fmt: skip
    del theirs
    big = pipe.request("x", resolution=1024, **common)
    large = dict(common, width=big.width, height=big.height)
    result["per_step_ms_1024"] = statistics.median(ours_per_step(pipe, max(args.steps // 2, 2), **large))
    print(f"1024 bucket ({big.width}x{big.height}), ours ms/step with CFG: "
          f"{result['per_step_ms_1024']:.1f}", flush=True)  # fmt: skip
    result["total_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
