"""`qwen-image`: generate images, inspect a model, run the web demo.

User errors (bad arguments, bad checkpoints) print one line `error: ...` and exit 2, no traceback.
"""

import argparse
import dataclasses
import ipaddress
import logging
import math
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import PIL.Image

from models.errors import InputError, ParallelError, QwenImageError
from models.geometry import size_multiple
from models.prompt_template import DEFAULT_SEQUENCE_LENGTH, MAX_SEQUENCE_LENGTH
from pipelines.limits import (
    DEFAULT_TRUE_CFG_SCALE,
    MAX_IMAGES,
    MAX_SIDE,
    MAX_STEPS,
    MIN_STEPS,
    SIZE_MULTIPLE,
    as_prompt_list,
    check_generation_args,
    check_size,
    check_steps,
)
from pipelines.presets import LORA_MODES, PRESETS, LoraSpec, find_lora_files, get_preset, parse_lora_spec
from ui.limits import DEVICE_LIMITS, Limits

if TYPE_CHECKING:
    from models.lora import LoraFile

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
    parser.add_argument("--dtype", default="bf16", help="bf16 or fp32")
    parser.add_argument(
        "--variant", default="auto", help="reference, contract, fp8-unfused, fp8-fused or auto"
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
    gen.add_argument("-o", "--out", default="out.png", help="output PNG (index appended for several images)")
    gen.add_argument("--negative-prompt", help="enables true CFG when --true-cfg-scale > 1 (default: none)")
    side = f"a multiple of {SIZE_MULTIPLE} up to {MAX_SIDE} for Qwen-Image's VAE"
    model_default = "default: the model's, 1024 for Qwen-Image checkpoints, 256 for the embedded model"
    gen.add_argument("--width", type=int, help=f"image width in pixels, {side} ({model_default})")
    gen.add_argument("--height", type=int, help=f"image height in pixels, {side} ({model_default})")
    gen.add_argument(
        "--steps",
        type=int,
        dest="num_inference_steps",
        help=f"denoising steps, {MIN_STEPS}..{MAX_STEPS}; a --preset sets its own "
        "(default: 50, 20 for the embedded model)",
    )
    gen.add_argument(
        "--true-cfg-scale",
        type=float,
        help="true CFG scale; needs a negative prompt; a --preset sets 1.0 "
        f"(default: {DEFAULT_TRUE_CFG_SCALE})",
    )
    gen.add_argument("--seed", type=int, help="random seed (default: a random one, printed)")
    gen.add_argument(
        "--num-images", type=int, default=1, dest="num_images_per_prompt", help=f"images, 1..{MAX_IMAGES}"
    )
    gen.add_argument(
        "--max-sequence-length",
        type=int,
        default=DEFAULT_SEQUENCE_LENGTH,
        help=f"text tokens kept, 1..{MAX_SEQUENCE_LENGTH}",
    )
    _add_lora_args(gen)
    gen.add_argument(
        "--lora-mode",
        choices=LORA_MODES,
        default="branch",
        help="branch: each LoRA beside its layers, FP8 paths stay fused (dual output); "
        "merge: folded into the weights, no extra GEMMs (FP8 weights requantized)",
    )
    gen.add_argument("--preset", choices=list(PRESETS), help=PRESET_HELP)
    _add_model_args(gen)
    _add_gpus_arg(gen, "generate")

    info = command("info", "components, dtypes, parameter counts, quantization and fusion")
    _add_model_args(info)
    _add_gpus_arg(info, "also show the parallel plans")

    quant = command("quantize", "calibrate static FP8 scales and write a ModelOpt FP8 checkpoint")
    quant.add_argument("--model", help="BF16 checkpoint dir (default: the embedded model)")
    quant.add_argument("--out", required=True, help="new checkpoint directory")
    quant.add_argument("--calib-prompts", help="text file, one prompt per line (default: a built-in set)")
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
    _add_lora_args(quant, "bake into the BF16 weights before calibration")
    quant.add_argument(
        "--preset", choices=list(PRESETS), help="calibrate with a preset's steps, CFG and scheduler"
    )

    ui = command("ui", "the Gradio web demo: one model, requests queued and run one at a time")
    ui.epilog = (
        "By default only this machine can open the page. To serve others, listen on another address with "
        "accounts: qwen-image ui --host 0.0.0.0 --auth alice:s3cret (or --auth-file FILE, one USER:PASS per "
        "line). --no-auth serves without sign-in."
    )
    _add_ui_args(ui)
    ui.add_argument("--lora-dir", help="offer the *.safetensors LoRAs of this directory, each with a scale")
    _add_model_args(ui)
    _add_gpus_arg(ui, "serve")
    return parser


def _add_ui_args(ui: argparse.ArgumentParser) -> None:
    """Where `qwen-image ui` listens, who may sign in, and the job limits (their defaults by device)."""
    cuda, cpu = DEVICE_LIMITS["cuda"], DEVICE_LIMITS["cpu"]
    default = {f.name: f.default for f in dataclasses.fields(Limits)}
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: 127.0.0.1 is this machine only; any other needs an --auth account "
        "or --no-auth",
    )
    ui.add_argument("--port", type=int, default=7860, help="port to listen on")
    ui.add_argument(
        "--auth",
        action="append",
        type=_account,
        metavar="USER:PASS",
        help="an account that may sign in; repeatable",
    )
    ui.add_argument(
        "--auth-file", type=Path, metavar="FILE", help="accounts: one USER:PASS per line, # comments"
    )
    ui.add_argument(
        "--no-auth", action="store_true", help="listen on a non-loopback --host without sign-in (warns)"
    )
    limits = ui.add_argument_group("job limits")
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
        f"(default: {default['jobs_per_client']})",
    )
    limits.add_argument(
        "--keep-images",
        type=_positive(float),
        metavar="MINUTES",
        help="generated images are deleted from the server after this long "
        f"(default: {default['keep_images_minutes']:g})",
    )


def _account(text: str) -> tuple[str, str]:
    """USER:PASS -> (user, password); the password may contain ':'."""
    user, sep, password = text.partition(":")
    if not (sep and user and password):
        raise argparse.ArgumentTypeError(f"expected USER:PASS, got {text!r}")
    return user, password


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


def _read_loras(specs: list[LoraSpec]) -> list[tuple["LoraFile", float]]:
    """Read every --lora before the model loads, so a bad file fails in seconds."""
    if not specs:
        return []
    from models.lora import read_lora_file

    return [(read_lora_file(spec.path), spec.scale) for spec in specs]


def is_leader_process() -> bool:
    """Rank 0 of a launched run, or a plain process: the one that prints and writes files."""
    return os.environ.get("RANK", "0") == "0"


def _load(args: argparse.Namespace, parallel=None):
    from pipelines import load_pipeline

    if is_leader_process():
        where = "" if parallel is None else f" as {parallel.describe()}"
        print(f"loading {args.model or 'the embedded default model'}{where} ...", file=sys.stderr)
    return load_pipeline(
        args.model, variant=args.variant, device=args.device, dtype=args.dtype, parallel=parallel
    )


def _plan(args: argparse.Namespace, true_cfg: bool):
    """None for one process; else the plan for `--gpus N` (checked against the model's heads and the
    visible GPUs before anything loads) or for the ranks a launcher started."""
    from pipelines.parallel import attention_heads, launched_world_size, plan_for

    world = launched_world_size()
    if world == 1 and args.gpus == 1:
        return None
    if world > 1 and args.gpus not in (1, world):
        raise InputError(f"--gpus {args.gpus}, but the launcher started {world} ranks")
    plan = plan_for(max(world, args.gpus), attention_heads(args.model), true_cfg)
    if world == 1:
        _check_gpus_visible(args.gpus, args.device)
    return plan


def _check_gpus_visible(gpus: int, device: str | None) -> None:
    import torch

    if device is not None and device.startswith("cpu"):
        raise InputError(
            "--gpus starts one rank per GPU; for gloo ranks on the CPU run "
            "`torchrun --nproc_per_node N -m ui.cli ... --device cpu`"
        )
    visible = torch.cuda.device_count()
    if visible < gpus:
        raise InputError(f"--gpus {gpus}, but {visible} CUDA GPUs are visible on this machine")


def _is_launcher() -> bool:
    """True in the process the user started (it launches the ranks), False in a rank."""
    from pipelines.parallel import launched_world_size

    return launched_world_size() == 1


def _launch(args: argparse.Namespace, plan) -> None:
    """Start the ranks of `plan`, each running this same command line (ui/launch.py)."""
    from ui.launch import launch_ranks

    print(f"starting {plan.describe()}", file=sys.stderr)
    launch_ranks(plan.world_size, [sys.executable, "-m", "ui.cli", *args.argv])


def _leave_ranks() -> None:
    if "torch.distributed" in sys.modules:  # only a rank has joined a process group
        from pipelines.parallel import leave_ranks

        leave_ranks()


def _true_cfg(args: argparse.Namespace) -> bool:
    preset = get_preset(args.preset)
    default = DEFAULT_TRUE_CFG_SCALE if preset is None else preset.true_cfg_scale
    scale = default if args.true_cfg_scale is None else args.true_cfg_scale
    return args.negative_prompt is not None and scale > 1


def image_paths(out: Path, count: int) -> list[Path]:
    """Where `count` images go: `out` itself, or `out` with an index for several."""
    if out.suffix.lower() not in PIL.Image.registered_extensions():
        raise InputError(f"output {out} needs an image extension such as .png")
    return [out] if count == 1 else [out.with_stem(f"{out.stem}-{i}") for i in range(count)]


def model_size_multiple(model: str | None) -> int:
    """What image sides must be multiples of, read from the checkpoint's VAE config without loading it."""
    return SIZE_MULTIPLE if model is None else size_multiple(Path(model))


def check_generate_args(args: argparse.Namespace) -> None:
    """Every generation argument and the output name, checked before any model loads."""
    image_paths(
        Path(args.out), args.num_images_per_prompt if isinstance(args.num_images_per_prompt, int) else 1
    )
    check_generation_args(
        as_prompt_list(args.prompt, "prompt"),
        as_prompt_list(args.negative_prompt, "negative_prompt"),
        args.width,
        args.height,
        args.num_inference_steps,
        args.true_cfg_scale,
        args.num_images_per_prompt,
        args.max_sequence_length,
        args.seed,
        model_size_multiple(args.model),
    )


def cmd_generate(args: argparse.Namespace) -> None:
    check_generate_args(args)
    lora_specs = [parse_lora_spec(text) for text in args.lora or []]  # before any rank starts
    plan = _plan(args, _true_cfg(args))
    if plan is not None and _is_launcher():
        _launch(args, plan)
        return
    loras = _read_loras(lora_specs)
    pipe = _load(args, plan)
    for lora_file, scale in loras:
        pipe.load_lora(lora_file, scale)
    pipe.set_lora_mode(args.lora_mode)
    names = ("width", "height", "num_inference_steps", "seed", "num_images_per_prompt", "max_sequence_length")
    options = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    images = pipe.generate(
        args.prompt,
        negative_prompt=args.negative_prompt,
        true_cfg_scale=args.true_cfg_scale,
        progress=is_leader_process(),
        preset=args.preset,
        **options,
    )
    if not is_leader_process():
        return
    paths = image_paths(Path(args.out), len(images))
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for image, path in zip(images, paths, strict=True):
        image.save(path)
    run = pipe.last_run
    t = run.timings
    print(
        f"wrote {', '.join(map(str, paths))} "
        f"({run.width}x{run.height}, seed {run.seed}, variant {run.variant})"
    )
    print(
        f"text encoding {t['text_encoding']:.2f} s | denoising {t['denoising']:.2f} s "
        f"({run.ms_per_step:.0f} ms/step x {run.num_inference_steps}) | decoding {t['decoding']:.2f} s "
        f"| total {t['total']:.2f} s"
    )
    print(run.fusion_summary)
    print(f"parallel: {pipe.parallel_summary()}")
    if run.preset:
        print(f"preset: {get_preset(run.preset).describe()}")
    if run.loras:
        print(run.loras)
    if pipe.lora_merge is not None:
        print(pipe.lora_merge.summary())


def cmd_info(args: argparse.Namespace) -> None:
    from pipelines.info import describe, describe_plans

    plans = describe_plans(args.gpus, args.model) if args.gpus > 1 else None
    print(describe(_load(args)))
    if plans:
        print(plans)


def cmd_quantize(args: argparse.Namespace) -> None:
    from pipelines.prompts import read_prompt_file
    from pipelines.quantize import DEFAULT_BF16_FALLBACK, DEFAULT_CALIBRATION_PROMPTS, quantize_checkpoint

    if args.steps is not None:
        check_steps(args.steps)
    if args.size is not None:
        check_size(args.size, args.size, model_size_multiple(args.model))
    prompts = DEFAULT_CALIBRATION_PROMPTS
    if args.calib_prompts:
        prompts = read_prompt_file(Path(args.calib_prompts))
    ignore = (
        DEFAULT_BF16_FALLBACK if args.keep_bf16 is None else tuple(filter(None, args.keep_bf16.split(",")))
    )
    out = quantize_checkpoint(
        args.model,
        Path(args.out),
        prompts,
        ignore,
        steps=args.steps,
        size=args.size,
        device=args.device,
        loras=_read_loras([parse_lora_spec(text) for text in args.lora or []]),
        preset=args.preset,
    )
    print(f"wrote {out}")
    print(f"check it with: qwen-image info --model {out}")


def read_accounts(path: Path) -> list[tuple[str, str]]:
    """USER:PASS lines of an auth file (blank lines and # comments skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read auth file {path}: {err}") from None
    accounts = []
    for number, line in enumerate(lines, 1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                accounts.append(_account(line.strip()))
            except argparse.ArgumentTypeError:
                raise InputError(f"{path} line {number}: expected USER:PASS") from None
    if not accounts:
        raise InputError(f"auth file {path} has no USER:PASS line")
    return accounts


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps the demo on this machine (127.0.0.0/8, ::1, or a name for them)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return all(ipaddress.ip_address(address).is_loopback for address in addresses)


def ui_accounts(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The accounts `qwen-image ui` requires. A non-loopback --host needs one, or an explicit --no-auth
    (then a warning): refused here, before anything loads."""
    accounts = list(args.auth or []) + (read_accounts(args.auth_file) if args.auth_file else [])
    if args.no_auth and accounts:
        raise InputError("--no-auth contradicts --auth/--auth-file: give one or the other")
    if is_loopback(args.host):
        return accounts
    if not accounts and not args.no_auth:
        raise InputError(
            f"--host {args.host} serves the demo beyond this machine: add --auth USER:PASS (or --auth-file "
            "FILE), or --no-auth to let anyone who can reach it in"
        )
    if args.no_auth and is_leader_process():
        print(
            f"warning: serving on {args.host}:{args.port} without sign-in (--no-auth): anyone who can reach "
            "this port can use the model on this machine",
            file=sys.stderr,
        )
    return accounts


def cmd_ui(args: argparse.Namespace) -> None:
    accounts = ui_accounts(args)  # an open address is refused before anything loads or any rank starts
    lora_files = None if args.lora_dir is None else find_lora_files(Path(args.lora_dir))
    plan = _plan(args, true_cfg=True)
    if plan is not None and _is_launcher():
        _launch(args, plan)
        return
    from ui.app import launch

    if is_leader_process():
        print(f"loading {args.model or 'the embedded default model'} ...", file=sys.stderr)
    limits = {
        "max_work": args.max_work,
        "time_limit_s": args.time_limit,
        "queue_size": args.queue_size,
        "jobs_per_client": args.jobs_per_client,
        "keep_images_minutes": args.keep_images,
    }
    launch(
        args.model,
        host=args.host,
        port=args.port,
        variant=args.variant,
        device=args.device,
        dtype=args.dtype,
        parallel=plan,
        lora_files=lora_files,
        limits=limits,
        auth=accounts or None,
        on_start=lambda port, applied: print(
            _serving_message(args.host, port, len(accounts), applied), flush=True
        ),
    )


def _serving_message(host: str, port: int, accounts: int, limits: Limits) -> str:
    """What the console says once the demo is up: where, who may sign in, how to serve others, limits."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    wildcard = (
        f": every address of this machine, http://127.0.0.1:{port} here" if host in ("0.0.0.0", "::") else ""
    )
    lines = [f"Qwen-Image demo on {url}{wildcard} (Ctrl+C stops it)."]
    if accounts:
        lines.append(f"Sign-in required: {accounts} account{'s' if accounts > 1 else ''}.")
    if is_loopback(host):
        lines.append(
            "Only this machine can open it. To serve others: qwen-image ui --host 0.0.0.0 --auth USER:PASS "
            "(or --auth-file FILE); see qwen-image ui --help."
        )
    lines.append(
        f"Limits: {limits.max_work:g} megapixel-steps and {limits.time_limit_s:g} s per request, "
        f"{limits.queue_size} waiting, {limits.jobs_per_client} per client."
    )
    return "\n".join(lines)


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "generate": cmd_generate,
    "info": cmd_info,
    "quantize": cmd_quantize,
    "ui": cmd_ui,
}


def show_library_warnings() -> None:
    """Our own warnings (e.g. a prompt cut at max_sequence_length) as one `warning: ...` line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    log = logging.getLogger("qwen_image")
    log.handlers[:] = [handler]
    log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    from ui.launch import USER_ERROR_STATUS, RanksFailed

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if is_leader_process():
        show_library_warnings()
    else:  # the other ranks see the same prompts: rank 0 speaks for them
        logging.getLogger("qwen_image").setLevel(logging.ERROR)
    try:
        COMMANDS[args.command](args)
        _leave_ranks()
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
