"""One pipeline in its own process, driven over JSON lines: `python -m qwen_image_fusion.eval.worker --variant
NAME ...`.

Protocol: one ASCII JSON object per line (so no locale matters); stdout carries only these replies,
everything else the pipeline prints goes to stderr.
  first reply   {"event": "ready", "variant", "device", "dtype", "model_name", "fusion_summary",
                 "load_seconds", "width", "height", "steps"}    (width/height/steps: pipe.defaults;
                                                                 width/height null for a model that edits
                                                                 or takes control maps)
  request       {"id", "png", and the eval keys of the request options (pipelines/options.py): "prompt",
                 "seed", "width", "height", "steps", "negative_prompt", "true_cfg_scale", "images",
                 "init_image", "mask", "strength", "control", "control_mode", "control_scale",
                 "control_mask"}                                (null or absent: the default; image keys:
                                                                 files, lists may be []; another key is
                                                                 refused by name)
  reply         {"event": "done", "id", "seconds", "seed", "width", "height", "steps", "timings",
                 "cache", "decode"}                             (what ran: RunInfo's cache and decode)
  on error      {"event": "error", "id" (absent at load), "error": one line, "user_error": bool}
The worker exits when stdin closes, or after a load error. Its per-variant flags (`--cache`,
`--fast-decode`) are built from the same declarations as the CLI's.
"""

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from typing import TextIO

from qwen_image_fusion.models.errors import InputError, QwenImageError
from qwen_image_fusion.pipelines.options import GENERATE, IMAGE, IMAGES, OPTION, OPTIONS, add_flag


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


PROTOCOL_KEYS = ("id", "png")  # a request's own keys beside its options'
PER_WORKER = ("cache", "fast_decode")  # options a worker applies to every request (its variant's)


def request_values(request: dict) -> tuple[str, dict]:
    """A request line's prompt and `generate()` values, read by the eval keys of the declared options:
    image keys opened, absent keys left to the defaults; InputError naming an unknown key."""
    from qwen_image_fusion.pipelines.images import open_input_image

    options = {option.eval: option for option in OPTIONS if option.eval and option.name not in PER_WORKER}
    unknown = sorted(set(request) - set(options) - set(PROTOCOL_KEYS))
    if unknown:
        raise InputError(
            f"unknown request key {unknown[0]!r}: the worker takes {', '.join(options)}", unknown[0]
        )
    values = {}
    for key, option in options.items():
        value = request.get(key)
        if option.kind == IMAGE and value is not None:
            value = open_input_image(value, field=option.name)
        elif option.kind == IMAGES:
            value = [open_input_image(path, field=option.name) for path in value or ()] or None
        values[option.name] = value
    return values.pop("prompt"), values


def generate(pipe: object, request: dict, per_worker: dict) -> dict:
    """One request (its values and the worker's `per_worker` options), its image written to its `png`."""
    start = time.perf_counter()
    prompt, values = request_values(request)
    images = pipe.generate(prompt, **values, **per_worker)
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


def build_parser() -> argparse.ArgumentParser:
    """The worker's load options, and its per-worker request options as declared (their CLI flags)."""
    parser = argparse.ArgumentParser(
        prog="python -m qwen_image_fusion.eval.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--variant", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    for name in PER_WORKER:
        add_flag(parser, OPTION[name], OPTION[name].cli[GENERATE])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    per_worker = {name: getattr(args, name) for name in PER_WORKER}
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
            send(channel, generate(pipe, request, per_worker))
        except Exception as exc:
            send_error(channel, exc, id=request.get("id"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
