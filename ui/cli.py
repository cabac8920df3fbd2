"""`qwen-image`: generate and edit images, inspect a model, run the web demo or the HTTP image server.

User errors (bad arguments, bad checkpoints) print one line `error: ...` and exit 2, no traceback.
"""

import argparse
import dataclasses
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from qwen_image_fusion.models.cache_presets import CACHE_OFF, CACHE_PRESETS
from qwen_image_fusion.models.errors import ParallelError, QwenImageError
from qwen_image_fusion.models.family import (
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_TRUE_CFG_SCALE,
    MAX_SEQUENCE_LENGTH,
)
from qwen_image_fusion.pipelines.control import CONTROL_MODES
from qwen_image_fusion.pipelines.generation_request import MAX_LAYERS
from qwen_image_fusion.pipelines.launch_env import is_leader_process
from qwen_image_fusion.pipelines.limits import (
    DTYPE_NAMES,
    MAX_IMAGES_PER_PROMPT,
    MAX_INPUT_PIXELS,
    MAX_SIDE,
    MAX_STEPS,
    MIN_STEPS,
)
from qwen_image_fusion.pipelines.presets import LORA_MODES, PRESETS
from qwen_image_fusion.pipelines.variants import AUTO, VARIANTS
from qwen_image_fusion.ui.access import parse_account
from qwen_image_fusion.ui.commands import COMMANDS
from qwen_image_fusion.ui.limits import DEVICE_LIMITS, Limits
from qwen_image_fusion.ui.uploads import upload_caps

PRESET_HELP = "settings for a distilled LoRA (explicit --steps / --true-cfg-scale win): " + "; ".join(
    p.describe() for p in PRESETS.values()
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default; options whose default depends on the model say so in their help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local diffusers-layout checkpoint dir (default: the embedded model)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available, else cpu)")
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        help="every component in this dtype (default: bf16 where the device computes it natively; on a CPU "
        "without native BF16, fp32 for the VAE, and for the transformer unless the variant is BF16-only)",
    )
    parser.add_argument(
        "--variant",
        default=AUTO,
        help=f"{', '.join(VARIANTS)} or {AUTO} (fp8-fused on FP8 checkpoints; else contract, or reference "
        "in fp32 on a CPU without native BF16)",
    )
    parser.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="GPU memory this process may use, e.g. 24GiB, 24GB or 20000MiB (default: what the GPU has "
        "free): the weights are placed to fit (text encoder offloaded, transformer blocks streamed from host "
        "memory), same images; `qwen-image info --gpu-memory SIZE` prints the plan",
    )


def _add_mask_crop_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--padding-mask-crop",
        type=int,
        metavar="PIXELS",
        help="with --mask: generate only the box around the mask's white part, PIXELS wider on each side and "
        "widened to the output's aspect, then paste it back into the image (diffusers' padding_mask_crop)",
    )


def _add_gpus_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help=f"{what} on N GPUs of this machine: CFG-parallel when true CFG is on and N is even, Ulysses "
        "sequence parallel for the rest (README: Several GPUs)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-image", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=DefaultsHelpFormatter)

    gen = command("generate", "generate images from a prompt")
    gen.add_argument("prompt")
    _add_sampling_args(gen, "the model's, 1024 for Qwen-Image checkpoints, 256 for the embedded model")
    gen.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an input image for models that take them (Qwen-Image 2.1: condition images, at most 4), in "
        "order; repeatable. Without --width/--height the output takes the last image's aspect "
        "(`qwen-image info` says how many a model takes)",
    )
    gen.add_argument(
        "--init-image",
        metavar="FILE",
        help="start from this image (img2img; Qwen-Image checkpoints): noised to --strength, then denoised "
        "by the prompt; without --width/--height the output takes its size (scaled down to the model's "
        "default area when larger)",
    )
    gen.add_argument(
        "--strength",
        type=float,
        help="img2img: how much of the schedule reworks --init-image, in (0, 1]; 1 starts from pure noise "
        "(default: 0.6, as diffusers)",
    )
    gen.add_argument(
        "--mask",
        metavar="FILE",
        help="inpainting: repaint only the white part of --init-image (grey levels binarized at 0.5; the "
        "image's size)",
    )
    _add_mask_crop_arg(gen)
    gen.add_argument(
        "--control-image",
        action="append",
        metavar="FILE",
        help="a control map for a ControlNet checkpoint (canny, depth, pose or soft-edge map; the Union "
        "ControlNet reads which from the map); repeatable: each guides at its own --control-scale. Without "
        "--width/--height the output takes the first map's size (scaled down to the model's default area)",
    )
    gen.add_argument(
        "--control-scale",
        action="append",
        type=float,
        metavar="S",
        help="conditioning scale of each --control-image, in order (one value: every image; default 1.0)",
    )
    gen.add_argument(
        "--control-mask",
        metavar="FILE",
        help="an inpainting ControlNet checkpoint (QwenImageControlNetInpaintPipeline): repaint the white "
        "part of the one --control-image (the image's size)",
    )
    gen.add_argument(
        "--control-mode",
        choices=CONTROL_MODES,
        help="make each control map here from a photo (canny: its edges) instead of giving the map",
    )
    gen.add_argument(
        "--control-start",
        type=float,
        default=0.0,
        help="the share of the steps after which the control guides (diffusers' control_guidance_start)",
    )
    gen.add_argument(
        "--control-end",
        type=float,
        default=1.0,
        help="the share of the steps after which it stops guiding (diffusers' control_guidance_end)",
    )
    gen.add_argument(
        "--max-sequence-length",
        type=int,
        default=DEFAULT_SEQUENCE_LENGTH,
        help=f"text tokens kept, 1..{MAX_SEQUENCE_LENGTH}",
    )
    _add_lora_run_args(gen)
    _add_model_args(gen)
    _add_gpus_arg(gen, "generate")

    edit = command("edit", "edit images following an instruction (a Qwen-Image-Edit checkpoint)")
    edit.add_argument("prompt", metavar="instruction", help="what to change, e.g. 'make the sky red'")
    edit.add_argument(
        "--image",
        action="append",
        required=True,
        metavar="FILE",
        help=f"an input image (any format Pillow reads, at most {MAX_INPUT_PIXELS / 1e6:.1f} MP: 4096x4096); "
        "repeat it for a model that takes several (`qwen-image info` says how many: 3 for Edit-2509/2511, "
        "which call them Picture 1, 2, ... in this order)",
    )
    edit.add_argument(
        "--mask",
        metavar="FILE",
        help="an inpainting edit (Edit checkpoints, as diffusers' QwenImageEditInpaintPipeline; not Plus): "
        "repaint only the white part of the input image (grey levels binarized at 0.5; the image's size), "
        "starting from the image noised to --strength; the output takes the size the image suggests",
    )
    edit.add_argument(
        "--strength",
        type=float,
        help="with --mask: the share of the schedule that reworks the image, in (0, 1] (default: 0.6)",
    )
    _add_mask_crop_arg(edit)
    _add_sampling_args(
        edit, "the aspect of the first (Edit) or last (Plus) image at about 1024x1024 pixels, as diffusers"
    )
    _add_lora_run_args(edit)
    _add_model_args(edit)
    _add_gpus_arg(edit, "edit")
    edit.set_defaults(max_sequence_length=DEFAULT_SEQUENCE_LENGTH)  # Edit prompts ignore it, as in diffusers

    layers = command(
        "layers", "decompose an image into RGBA layers, one PNG each (a Qwen-Image-Layered checkpoint)"
    )
    layers.add_argument("image", metavar="IMAGE", help="the image to decompose (any format Pillow reads)")
    layers.add_argument(
        "--prompt",
        default="",
        help="a caption of the image; empty: the model's vision-language model writes one (printed), as "
        "diffusers does",
    )
    layers.add_argument(
        "--use-en-prompt",
        action="store_true",
        help="with an empty --prompt: caption in English (default: Chinese, diffusers' default)",
    )
    layers.add_argument(
        "--layers", type=int, default=4, help=f"RGBA layers to decompose it into, 1..{MAX_LAYERS}"
    )
    layers.add_argument(
        "--resolution",
        type=int,
        help="the output's area as a square of this side, at the image's aspect (diffusers' buckets: 640 "
        "and 1024; default 640); or give --width and --height",
    )
    _add_sampling_args(
        layers,
        "the image's aspect at about 640x640 pixels, as diffusers",
        (
            "layers",
            "output folder (created): layer-0.png, layer-1.png, ... (image-I-layer-J.png for several)",
        ),
    )
    layers.add_argument(
        "--max-sequence-length",
        type=int,
        default=DEFAULT_SEQUENCE_LENGTH,
        help=f"text tokens kept, 1..{MAX_SEQUENCE_LENGTH}",
    )
    _add_lora_run_args(layers)
    _add_model_args(layers)
    layers.set_defaults(gpus=1)

    info = command("info", "components, dtypes, parameter counts, quantization and fusion")
    _add_model_args(info)
    _add_gpus_arg(info, "also show the parallel plans")

    quant = command("quantize", "calibrate static FP8 scales and write a ModelOpt FP8 checkpoint")
    quant.add_argument("--model", help="BF16 checkpoint dir (default: the embedded model)")
    quant.add_argument("--out", required=True, help="new checkpoint directory")
    quant.add_argument(
        "--calib-prompts",
        help="text file, one prompt per line; for a checkpoint that edits, an edit set (.jsonl: one "
        '{"prompt": ..., "images": [...]} per line, image paths relative to it) (default: a built-in set: '
        "8 prompts, or the drawn image + instruction pairs of pipelines/edit_sets)",
    )
    quant.add_argument(
        "--steps", type=int, help="denoising steps per calibration prompt (default: the model's, at most 20)"
    )
    quant.add_argument(
        "--size", type=int, help="calibration image side in pixels (default: the model's default size)"
    )
    quant.add_argument("--device", help="cuda or cpu (default: cuda when available, else cpu)")
    quant.add_argument(
        "--keep-bf16",
        help="comma-separated module globs kept in BF16 (default: the DESIGN §3 fallback list)",
    )
    quant.add_argument(
        "--fp8-modulation",
        action="store_true",
        help="store the modulation linears (img_mod.1, txt_mod.1: 13.6 GB in BF16 at full size) in FP8 "
        "with one scale per output channel, read by an FP8 GEMV; halves them, changes the images slightly "
        "(BENCHMARKS.md: FP8 modulation)",
    )
    _add_lora_args(quant, "bake into the BF16 weights before calibration")
    quant.add_argument(
        "--preset", choices=list(PRESETS), help="calibrate with a preset's steps, CFG and scheduler"
    )

    ui = command("ui", "the Gradio web demo: one model, requests queued and run one at a time")
    ui.epilog = (
        "By default only this machine can open the page. To serve others, listen on another address with "
        "accounts: qwen-image ui --host 0.0.0.0 --auth alice:s3cret (or --auth-file FILE, one USER:PASS per "
        "line). --no-auth serves without sign-in. A model that edits images gets an Edit tab, which takes "
        f"{upload_caps()}; a text-to-image model's page takes no uploads (1 kB at most)."
    )
    _add_ui_args(ui)
    ui.add_argument("--lora-dir", help="offer the *.safetensors LoRAs of this directory, each with a scale")
    _add_model_args(ui)
    _add_gpus_arg(ui, "serve")

    serve = command(
        "serve",
        "the HTTP image server: the OpenAI Images API (/v1/images/generations, /v1/images/edits), "
        "requests batched, optionally the web demo on the same port",
    )
    serve.epilog = (
        "By default only this machine can reach it. To serve others, listen on another address with API "
        "keys: qwen-image serve --host 0.0.0.0 --api-key-file keys.txt (one key per line, at least 16 "
        "characters). "
        "--no-auth serves without keys."
    )
    _add_listen_args(serve, 8000, "an --api-key-file")
    serve.add_argument(
        "--api-key-file",
        type=Path,
        metavar="FILE",
        help="API keys, one per line (# comments): requests must send Authorization: Bearer KEY",
    )
    serve.add_argument(
        "--no-auth", action="store_true", help="listen on a non-loopback --host without API keys (warns)"
    )
    serve.add_argument(
        "--ui",
        action="store_true",
        help="also serve the web demo at /ui on the same port and job queue (sign in: any user name, an API "
        "key as the password, when there are keys)",
    )
    serve.add_argument(
        "--max-batch",
        type=_positive(int),
        default=1,
        metavar="IMAGES",
        help="image rows one denoising step may hold: requests with the same settings share a step, and "
        "every batch runs at its full size so each image equals the same request served alone (a lone "
        "request computes the whole batch); 1 runs each request alone, as generate does; on CUDA also "
        "bounded by free memory",
    )
    serve.add_argument(
        "--batch-window-ms",
        type=_positive(float),
        default=20.0,
        metavar="MS",
        help="how long an idle server waits for requests that can share the first one's batch",
    )
    _add_limit_args(serve, http=True)
    serve.add_argument(
        "--lora-dir", help="load the *.safetensors LoRAs of this directory at scale 0 (lora_scales)"
    )
    _add_model_args(serve)
    return parser


def _add_listen_args(parser: argparse.ArgumentParser, port: int, credentials: str) -> None:
    """Where a server listens: --host (loopback by default) and --port."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"address to listen on: 127.0.0.1 is this machine only; any other needs {credentials} or "
        "--no-auth",
    )
    parser.add_argument("--port", type=int, default=port, help="port to listen on")


def _add_ui_args(ui: argparse.ArgumentParser) -> None:
    """Where `qwen-image ui` listens, who may sign in, and the job limits (their defaults by device)."""
    _add_listen_args(ui, 7860, "an --auth account")
    ui.add_argument(
        "--auth",
        action="append",
        type=parse_account,
        metavar="USER:PASS",
        help="an account that may sign in; repeatable",
    )
    ui.add_argument(
        "--auth-file", type=Path, metavar="FILE", help="accounts: one USER:PASS per line, # comments"
    )
    ui.add_argument(
        "--no-auth", action="store_true", help="listen on a non-loopback --host without sign-in (warns)"
    )
    _add_limit_args(ui)


def _add_limit_args(parser: argparse.ArgumentParser, http: bool = False) -> None:
    """The job limits (their defaults by device); with `http`, the HTTP server's size bounds too."""
    cuda, cpu = DEVICE_LIMITS["cuda"], DEVICE_LIMITS["cpu"]
    default = {f.name: f.default for f in dataclasses.fields(Limits)}
    limits = parser.add_argument_group("job limits")
    limits.add_argument(
        "--max-work",
        type=_positive(float),
        metavar="MP_STEPS",
        help="largest request, in megapixel-steps: width x height / 1e6 x steps x images, x2 with true "
        f"CFG; larger ones are refused (default: {cuda[0]:g} on CUDA, {cpu[0]:g} on CPU)",
    )
    limits.add_argument(
        "--time-limit",
        type=_positive(float),
        metavar="SECONDS",
        help="a running request is stopped after this long "
        f"(default: {cuda[1]:g} on CUDA, {cpu[1]:g} on CPU)",
    )
    limits.add_argument(
        "--queue-size",
        type=_positive(int),
        metavar="N",
        help=f'requests that may wait; more get "queue full" (default: {default["queue_size"]})',
    )
    limits.add_argument(
        "--jobs-per-client",
        type=_positive(int),
        metavar="N",
        help="requests one browser tab or API client may have waiting or running "
        + ("(the web demo's; the HTTP API is bounded by --queue-size alone) " if http else "")
        + f"(default: {default['jobs_per_client']})",
    )
    limits.add_argument(
        "--keep-images",
        type=_positive(float),
        metavar="MINUTES",
        help="generated images are deleted from the server after this long "
        f"(default: {default['keep_images_minutes']:g})",
    )
    if not http:
        return
    for flag, name, what in (
        ("--max-body-mb", "max_body_mb", "largest JSON request body"),
        ("--max-upload-mb", "max_upload_mb", "largest multipart request (an edit's input images)"),
        ("--cache-mb", "cache_mb", "images kept for response_format=url (the oldest go first)"),
    ):
        limits.add_argument(
            flag, type=_positive(float), metavar="MB", help=f"{what} (default: {default[name]:g})"
        )


def _positive(kind: type) -> Callable[[str], float]:
    """An argparse type: a finite number of `kind` above zero."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _add_sampling_args(
    parser: argparse.ArgumentParser,
    size_default: str,
    out: tuple[str, str] = ("out.png", "output PNG (index appended for several images)"),
) -> None:
    """The options `generate`, `edit` and `layers` share: output (default, help), negative prompt, size,
    steps, CFG, seed, count."""
    parser.add_argument("-o", "--out", default=out[0], help=out[1])
    parser.add_argument(
        "--negative-prompt",
        help="enables true CFG when --true-cfg-scale > 1 (default: the model's: none for diffusers "
        'checkpoints, " " for the embedded model, which was trained for it)',
    )
    side = f"a multiple of the model's size multiple (16 for Qwen-Image: `qwen-image info`) up to {MAX_SIDE}"
    parser.add_argument("--width", type=int, help=f"image width in pixels, {side} (default: {size_default})")
    parser.add_argument(
        "--height", type=int, help=f"image height in pixels, {side} (default: {size_default})"
    )
    parser.add_argument(
        "--steps",
        type=int,
        dest="num_inference_steps",
        help=f"denoising steps, {MIN_STEPS}..{MAX_STEPS}; a --preset sets its own "
        "(default: the model's, 50; 20 for the embedded model)",
    )
    parser.add_argument(
        "--true-cfg-scale",
        type=float,
        help="true CFG scale; needs a negative prompt; 1 turns CFG off; a --preset sets 1.0 "
        f"(default: the model's, {DEFAULT_TRUE_CFG_SCALE:g})",
    )
    parser.add_argument("--seed", type=int, help="random seed (default: a random one, printed)")
    parser.add_argument(
        "--cache",
        choices=[CACHE_OFF, *CACHE_PRESETS],
        help="step cache, opt-in and approximate: skip the middle blocks while the first block's output "
        + "barely changes; "
        + "; ".join(p.describe() for p in CACHE_PRESETS.values())
        + " (default: off, every block runs; docs/DESIGN.md §13 gives the measured difference)",
    )
    parser.add_argument(
        "--fast-decode",
        action="store_true",
        help="decode with the VAE's 2D form, opt-in and approximate: about 40%% less decoding time, a few "
        "pixel levels off the exact decode (BENCHMARKS.md, fast decode); Qwen-Image's VAE only",
    )
    parser.add_argument(
        "--num-images",
        type=int,
        default=1,
        dest="num_images_per_prompt",
        help=f"images, 1..{MAX_IMAGES_PER_PROMPT}",
    )


def _add_lora_run_args(parser: argparse.ArgumentParser) -> None:
    """LoRAs to run with, their mode, and a distilled LoRA's preset (`generate` and `edit`)."""
    _add_lora_args(parser)
    parser.add_argument(
        "--lora-mode",
        choices=LORA_MODES,
        default="branch",
        help="branch: each LoRA beside its layers, FP8 paths stay fused (dual output); "
        "merge: folded into the weights, no extra GEMMs (FP8 weights requantized)",
    )
    parser.add_argument("--preset", choices=list(PRESETS), help=PRESET_HELP)


def _add_lora_args(parser: argparse.ArgumentParser, what: str = "apply") -> None:
    parser.add_argument(
        "--lora",
        action="append",
        metavar="FILE[:SCALE]",
        help=f"LoRA safetensors file to {what} (diffusers/PEFT, kohya, ComfyUI or Lightning layout), "
        "scale 1.0 by default; repeat to stack several",
    )


def leave_ranks() -> None:
    """Leave the process group after a run that ended well (only a rank has joined one)."""
    if "torch.distributed" in sys.modules:
        from qwen_image_fusion.pipelines.parallel import leave_ranks as leave

        leave()


def show_library_warnings() -> None:
    """Our own warnings (e.g. a prompt cut at max_sequence_length) as one `warning: ...` line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    log = logging.getLogger("qwen_image")
    log.handlers[:] = [handler]
    log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    from qwen_image_fusion.ui.launch import USER_ERROR_STATUS, RanksFailed

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if is_leader_process():
        show_library_warnings()
    else:  # the other ranks see the same prompts: rank 0 speaks for them
        logging.getLogger("qwen_image").setLevel(logging.ERROR)
    try:
        COMMANDS[args.command](args)
        leave_ranks()
    except RanksFailed as err:  # the ranks printed a user error themselves
        if err.status != USER_ERROR_STATUS:
            print(f"error: {err}", file=sys.stderr)
        return USER_ERROR_STATUS if err.status == USER_ERROR_STATUS else 1
    except ParallelError as err:  # every rank that sees it says so
        print(f"error: {err}", file=sys.stderr)
        return 1
    except QwenImageError as err:
        if is_leader_process():  # the other ranks fail the same way, quietly
            print(f"error: {err}", file=sys.stderr)
        return USER_ERROR_STATUS
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
