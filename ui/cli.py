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

from qwen_image_fusion.models.checkpoint import QUANT_FORMATS
from qwen_image_fusion.models.errors import ParallelError, QwenImageError
from qwen_image_fusion.pipelines.launch_env import is_leader_process
from qwen_image_fusion.pipelines.limits import DTYPE_NAMES
from qwen_image_fusion.pipelines.options import EDIT, GENERATE, LAYERS, OPTION, add_flag, cli_options
from qwen_image_fusion.pipelines.presets import LORA_MODES
from qwen_image_fusion.pipelines.variants import AUTO, VARIANTS
from qwen_image_fusion.ui.access import parse_account
from qwen_image_fusion.ui.commands import COMMANDS
from qwen_image_fusion.ui.limits import DEVICE_LIMITS, Limits
from qwen_image_fusion.ui.uploads import upload_caps

# The commands that run one request: their help, and where `-o` writes by default (and what it names).
REQUEST_COMMANDS = {
    GENERATE: (
        "generate images from a prompt",
        ("out.png", "output PNG (index appended for several images)"),
    ),
    EDIT: (
        "edit images following an instruction (a Qwen-Image-Edit checkpoint)",
        ("out.png", "output PNG (index appended for several images)"),
    ),
    LAYERS: (
        "decompose an image into RGBA layers, one PNG each (a Qwen-Image-Layered checkpoint)",
        (
            "layers",
            "output folder (created): layer-0.png, layer-1.png, ... (image-I-layer-J.png for several)",
        ),
    ),
}
REQUIRED_FLAGS = {(EDIT, "image")}  # an edit needs its input images
LORA_MODE_HELP = (
    "branch: each LoRA beside its layers, FP8 paths stay fused (dual output); merge: folded into the "
    "weights, no extra GEMMs (FP8 weights requantized)"
)
UI_EPILOG = (
    "By default only this machine can open the page. To serve others, listen on another address with "
    "accounts: qwen-image ui --host 0.0.0.0 --auth alice:s3cret (or --auth-file FILE, one USER:PASS per "
    "line). --no-auth serves without sign-in. A model that edits images gets an Edit tab, which takes "
    "{uploads}; a text-to-image model's page takes no uploads (1 kB at most)."
)
SERVE_HELP = (
    "the HTTP image server: the OpenAI Images API (/v1/images/generations, /v1/images/edits), requests "
    "batched, optionally the web demo on the same port"
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default; options whose default depends on the model say so in their help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default in (None, "") else super()._get_help_string(action)


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


def _add_gpus_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help=f"{what} on N GPUs of this machine: CFG-parallel when true CFG is on and N is even, Ulysses "
        "sequence parallel for the rest (docs/gpu.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-image", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=DefaultsHelpFormatter)

    for name, (help, out) in REQUEST_COMMANDS.items():
        runs = command(name, help)
        runs.add_argument("-o", "--out", default=out[0], help=out[1])
        add_request_flags(runs, name)
        _add_lora_args(runs)
        runs.add_argument("--lora-mode", choices=LORA_MODES, default="branch", help=LORA_MODE_HELP)
        _add_model_args(runs)
        if name != LAYERS:
            _add_gpus_arg(runs, name)
        runs.set_defaults(gpus=1)

    info = command("info", "components, dtypes, parameter counts, quantization and fusion")
    _add_model_args(info)
    _add_gpus_arg(info, "also show the parallel plans")
    _add_quantize_command(
        command("quantize", "calibrate static scales and write a ModelOpt FP8 or NVFP4 checkpoint")
    )
    ui = command("ui", "the Gradio web demo: one model, requests queued and run one at a time")
    ui.epilog = UI_EPILOG.format(uploads=upload_caps())
    _add_ui_args(ui)
    ui.add_argument("--lora-dir", help="offer the *.safetensors LoRAs of this directory, each with a scale")
    _add_model_args(ui)
    _add_gpus_arg(ui, "serve")
    _add_serve_command(command("serve", SERVE_HELP))
    return parser


def add_request_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The request options CLI `command` takes, as flags built from their declarations (pipelines/options.py);
    a value the user gives none of is the declaration's `generate()` default (None: the pipeline's)."""
    for option, flag in cli_options(command):
        add_flag(parser, option, flag, required=(command, option.name) in REQUIRED_FLAGS)


def _add_quantize_command(quant: argparse.ArgumentParser) -> None:
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
        "--format",
        choices=QUANT_FORMATS,
        default=QUANT_FORMATS[0],
        help="fp8: E4M3 weights and inputs, per-tensor scales (DESIGN §3); nvfp4: 4-bit E2M1 weights with an "
        "E4M3 scale per 16 inputs (DESIGN §19; docs/nvfp4.md)",
    )
    quant.add_argument(
        "--keep-bf16",
        help="comma-separated module globs (or names: a module and all inside it) kept in BF16 (default: "
        "for fp8 the DESIGN §3 fallback list; for nvfp4 every linear outside the blocks and the first two "
        "and last two blocks)",
    )
    quant.add_argument(
        "--fp8-modulation",
        action="store_true",
        help="store the modulation linears (img_mod.1, txt_mod.1: 13.6 GB in BF16 at full size) in FP8 "
        "with one scale per output channel, read by an FP8 GEMV; halves them, changes the images slightly "
        "(BENCHMARKS.md: FP8 modulation)",
    )
    _add_lora_args(quant, "bake into the BF16 weights before calibration")
    preset = OPTION["preset"]
    quant.add_argument(
        "--preset", choices=preset.choices, help="calibrate with a preset's steps, CFG and scheduler"
    )


def _add_serve_command(serve: argparse.ArgumentParser) -> None:
    serve.epilog = (
        "By default only this machine can reach it. To serve others, listen on another address with API "
        "keys: qwen-image serve --host 0.0.0.0 --api-key-file keys.txt (one key per line, at least 16 "
        "characters). --no-auth serves without keys."
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


def _add_lora_args(parser: argparse.ArgumentParser, what: str = "apply") -> None:
    parser.add_argument(
        "--lora",
        action="append",
        metavar="FILE[:SCALE]",
        help=f"LoRA safetensors file to {what} (diffusers/PEFT, kohya, ComfyUI or Lightning layout), "
        "scale 1.0 by default; repeat to stack several",
    )


def error_text(err: QwenImageError, command: str) -> str:
    """A user error's line, led by the flag it concerns where the request option it names has one in
    `command` (a positional argument: its name)."""
    field = getattr(err, "field", None)
    flag = OPTION[field].cli.get(command) if field in OPTION else None
    return f"{flag}: {err}" if flag else str(err)


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
            print(f"error: {error_text(err, args.command)}", file=sys.stderr)
        return USER_ERROR_STATUS
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
