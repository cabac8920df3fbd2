"""One pipeline in its own process, driven over JSON lines: `python -m qwen_image_fusion.eval.worker --variant
NAME ...`.

Protocol: one ASCII JSON object per line (so no locale matters); stdout carries only these replies,
everything else the pipeline prints goes to stderr.
  first reply   {"event": "ready", "variant", "device", "dtype", "model_name", "fusion_summary",
                 "load_seconds", "width", "height", "steps"}    (width/height/steps: pipe.defaults;
                                                                 width/height null for a model that edits
                                                                 or takes control maps)
  request       {"id", "prompt", "seed", "width", "height", "steps", "negative_prompt",
                 "true_cfg_scale", "images", "init_image", "mask", "strength", "control", "control_mode",
                 "control_scale", "control_mask", "png"}        (null width/height/steps: defaults;
                                                                 images, control: image files, may be [])
  reply         {"event": "done", "id", "seconds", "seed", "width", "height", "steps", "timings"}
  on error      {"event": "error", "id" (absent at load), "error": one line, "user_error": bool}
The worker exits when stdin closes, or after a load error.
"""

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from typing import TextIO

from qwen_image_fusion.models.errors import QwenImageError


def open_protocol_channel() -> TextIO:
    """Keep the real stdout for replies and point fd 1 (and sys.stdout) at stderr."""
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def send(channel: TextIO, message: dict) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def send_error(channel: TextIO, exc: BaseException, **extra: object) -> None:
    """One-line error reply; an internal error also leaves its traceback on stderr."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    user_error = isinstance(exc, QwenImageError)
    if not user_error:
        traceback.print_exc()
        text = f"{type(exc).__name__}: {text}"
    send(channel, {"event": "error", **extra, "error": text, "user_error": user_error})


def dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def load(args: argparse.Namespace) -> tuple[object, dict]:
    from qwen_image_fusion.pipelines import load_pipeline

    start = time.perf_counter()
    pipe = load_pipeline(model=args.model, variant=args.variant, device=args.device, dtype=args.dtype)
    sized_by_images = pipe.spec.images_required or pipe.spec.takes_control
    info = {
        "event": "ready",
        "variant": pipe.variant,
        "device": str(pipe.device),
        "dtype": dtype_name(pipe.dtype),
        "model_name": pipe.model_name,
        "fusion_summary": pipe.fusion_summary(),
        "load_seconds": time.perf_counter() - start,
        "width": None if sized_by_images else pipe.defaults.width,  # edits, control maps: the images decide
        "height": None if sized_by_images else pipe.defaults.height,
        "steps": pipe.defaults.num_inference_steps,
    }
    return pipe, info


def side_by_side(images: list) -> object:
    """The one image a request compares by: its image, or a Layered request's layers left to right (equal
    bytes only where every layer's are equal)."""
    if len(images) == 1:
        return images[0]
    import PIL.Image

    strip = PIL.Image.new(images[0].mode, (sum(i.width for i in images), images[0].height))
    for index, image in enumerate(images):
        strip.paste(image, (index * image.width, 0))
    return strip


def generate(pipe: object, request: dict, cache: str | None = None, fast_decode: bool = False) -> dict:
    from qwen_image_fusion.pipelines.requests import Request

    start = time.perf_counter()
    inputs = Request(
        request["prompt"],
        tuple(request.get("images", [])),
        request.get("init_image"),
        request.get("mask"),
        request.get("strength"),
        tuple(request.get("control", [])),
        request.get("control_mode"),
        request.get("control_scale"),
        request.get("control_mask"),
    ).generation_inputs()
    images = pipe.generate(
        request["prompt"],
        negative_prompt=request.get("negative_prompt"),
        width=request.get("width"),
        height=request.get("height"),
        num_inference_steps=request.get("steps"),
        true_cfg_scale=request.get("true_cfg_scale", 4.0),
        seed=request["seed"],
        cache=cache,
        fast_decode=fast_decode,
        **inputs,
    )
    side_by_side(images).save(request["png"], format="PNG")
    run = pipe.last_run
    return {
        "event": "done",
        "id": request["id"],
        "seconds": time.perf_counter() - start,
        "seed": run.seed,
        "width": run.width,
        "height": run.height,
        "steps": run.num_inference_steps,
        "timings": dict(run.timings),
        "cache": None if run.cache is None else asdict(run.cache),
        "decode": None if run.decode is None else asdict(run.decode),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_image_fusion.eval.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--variant", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache", default=None, help="a step-cache preset for every image")
    parser.add_argument("--fast-decode", action="store_true", help="the VAE's 2D decode (approximate)")
    args = parser.parse_args(argv)
    channel = open_protocol_channel()
    try:
        pipe, info = load(args)
    except Exception as exc:
        send_error(channel, exc)
        return 2 if isinstance(exc, QwenImageError) else 1
    send(channel, info)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            send(channel, generate(pipe, request, args.cache, args.fast_decode))
        except Exception as exc:
            send_error(channel, exc, id=request.get("id"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
