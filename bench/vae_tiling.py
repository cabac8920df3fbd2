"""How much diffusers' tiled VAE decoding (what a memory plan switches on when whole images do not fit)
changes the images: the same final latents decoded whole and in tiles, PSNR, SSIM and max |diff|.

    python bench/vae_tiling.py --size 512 --out vae_tiling.json                      # embedded default, CPU
    python bench/vae_tiling.py --model /tmp/qwen-image-random-fp8 --size 1024 --out vae_tiling.json  # GPU
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from qwen_image_fusion.eval import metrics
from qwen_image_fusion.eval.scenes import held_out_scenes
from qwen_image_fusion.pipelines import load_pipeline


def decoded_both_ways(pipe, latents: torch.Tensor, canvas) -> tuple[np.ndarray, np.ndarray]:
    """The latents decoded whole and in tiles (diffusers' default tiles: 256 px, 64 px overlap)."""
    vae = pipe.components.vae
    vae.disable_tiling()  # whatever the memory plan chose for the run
    images = []
    for tiled in (False, True):
        if tiled:
            vae.enable_tiling()
        images.append(np.asarray(pipe.model.decode(latents, canvas).images[0].convert("RGB")))
    vae.disable_tiling()
    return images[0], images[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the embedded default)")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--images", type=int, default=8, help="held-out scenes, English captions")
    parser.add_argument("--device")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pipe = load_pipeline(args.model, device=args.device)
    canvas = pipe.model.canvas(args.size, args.size)
    rows, start = [], time.perf_counter()
    for i, scene in enumerate(held_out_scenes(args.images)):
        latents = pipe.generate(
            scene.captions["en"], width=args.size, height=args.size, num_inference_steps=args.steps, seed=i,
            output_type="latent",
        )  # fmt: skip
        whole, tiled = decoded_both_ways(pipe, latents, canvas)
        diff = np.abs(whole.astype(np.int16) - tiled.astype(np.int16))
        rows.append(
            {
                "psnr_db": metrics.psnr(whole, tiled),
                "ssim": metrics.ssim(whole, tiled),
                "max_abs_diff": int(diff.max()),
                "pixels_changed": float((diff > 0).any(axis=-1).mean()),
            }
        )
    result = {
        "model": pipe.model_name,
        "device": str(pipe.device),
        "size": args.size,
        "steps": args.steps,
        "images": rows,
        "median": {key: statistics.median(r[key] for r in rows) for key in rows[0]},
        "worst_psnr_db": min(r["psnr_db"] for r in rows),
        "seconds": time.perf_counter() - start,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "images"}, indent=2))


if __name__ == "__main__":
    main()
