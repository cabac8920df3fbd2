"""`qwen-image`: generate images, inspect a model, run the web demo.

User errors (bad arguments, bad checkpoints) print one line `error: ...` and exit 2, no traceback.
"""

import argparse
import dataclasses
import ipaddress
import math
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import PIL.Image

from models.errors import InputError, QwenImageError
from ui.limits import DEVICE_LIMITS, Limits


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local diffusers-layout checkpoint dir (default: the embedded model)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="bf16", help="bf16 (default) or fp32")
    parser.add_argument(
        "--variant", default="auto", help="reference, contract, fp8-unfused, fp8-fused or auto"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-image", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate images from a prompt")
    gen.add_argument("prompt")
    gen.add_argument("-o", "--out", default="out.png", help="output PNG (index appended for several images)")
    gen.add_argument("--negative-prompt", help="enables true CFG when --true-cfg-scale > 1")
    gen.add_argument("--width", type=int)
    gen.add_argument("--height", type=int)
    gen.add_argument("--steps", type=int, dest="num_inference_steps")
    gen.add_argument(
        "--true-cfg-scale", type=float, help="true CFG scale (default 4.0; needs a negative prompt)"
    )
    gen.add_argument("--seed", type=int)
    gen.add_argument("--num-images", type=int, default=1, dest="num_images_per_prompt")
    gen.add_argument("--max-sequence-length", type=int, help="text tokens kept, 1..1024 (default 512)")
    _add_model_args(gen)

    info = sub.add_parser("info", help="components, dtypes, parameter counts, quantization and fusion")
    _add_model_args(info)

    quant = sub.add_parser("quantize", help="calibrate static FP8 scales and write a ModelOpt FP8 checkpoint")
    quant.add_argument("--model", help="BF16 checkpoint dir (default: the embedded model)")
    quant.add_argument("--out", required=True, help="new checkpoint directory")
    quant.add_argument("--calib-prompts", help="text file, one prompt per line (default: a built-in set)")
    quant.add_argument("--steps", type=int, help="denoising steps per calibration prompt")
    quant.add_argument("--size", type=int, help="calibration image side in pixels")
    quant.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    quant.add_argument(
        "--keep-bf16",
        help="comma-separated module globs kept in BF16 (default: the DESIGN §3 fallback list)",
    )

    _add_ui_parser(sub)
    return parser


def _add_ui_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    cuda, cpu = DEVICE_LIMITS["cuda"], DEVICE_LIMITS["cpu"]
    default = {f.name: f.default for f in dataclasses.fields(Limits)}
    ui = sub.add_parser(
        "ui",
        help="the Gradio web demo",
        description="Serve the Gradio web demo: one model, requests queued and run one at a time.",
        epilog=(
            "By default only this machine can open the page. To serve others, listen on another\n"
            "address with accounts:  qwen-image ui --host 0.0.0.0 --auth alice:s3cret\n"
            "(or --auth-file FILE, one USER:PASS per line). --no-auth serves without sign-in."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; any other needs an --auth "
        "account or --no-auth)",
    )
    ui.add_argument("--port", type=int, default=7860, help="default 7860")
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
        f"CFG; larger ones are refused (default {cuda[0]:g} on CUDA, {cpu[0]:g} on CPU)",
    )
    limits.add_argument(
        "--time-limit",
        type=_positive(float),
        metavar="SECONDS",
        help=f"a running request is stopped after this long (default {cuda[1]:g} on CUDA, {cpu[1]:g} on CPU)",
    )
    limits.add_argument(
        "--queue-size",
        type=_positive(int),
        metavar="N",
        help=f'requests that may wait; more get "queue full" (default {default["queue_size"]})',
    )
    limits.add_argument(
        "--jobs-per-client",
        type=_positive(int),
        metavar="N",
        help="requests one browser tab or API client may have waiting or running "
        f"(default {default['jobs_per_client']})",
    )
    limits.add_argument(
        "--keep-images",
        type=_positive(float),
        metavar="MINUTES",
        help="generated images are deleted from the server after this long "
        f"(default {default['keep_images_minutes']:g})",
    )
    _add_model_args(ui)


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


def _load(args: argparse.Namespace):
    from pipelines import load_pipeline

    print(f"loading {args.model or 'the embedded default model'} ...", file=sys.stderr)
    return load_pipeline(args.model, variant=args.variant, device=args.device, dtype=args.dtype)


def image_paths(out: Path, count: int) -> list[Path]:
    """Where `count` images go: `out` itself, or `out` with an index for several."""
    if out.suffix.lower() not in PIL.Image.registered_extensions():
        raise InputError(f"output {out} needs an image extension such as .png")
    return [out] if count == 1 else [out.with_stem(f"{out.stem}-{i}") for i in range(count)]


def cmd_generate(args: argparse.Namespace) -> None:
    image_paths(Path(args.out), 1)  # refuse a bad output name before loading anything
    pipe = _load(args)
    names = ("width", "height", "num_inference_steps", "seed", "num_images_per_prompt", "max_sequence_length")
    options = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    images = pipe.generate(
        args.prompt,
        negative_prompt=args.negative_prompt,
        true_cfg_scale=args.true_cfg_scale,
        progress=True,
        **options,
    )
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


def cmd_info(args: argparse.Namespace) -> None:
    from pipelines.info import describe

    print(describe(_load(args)))


def cmd_quantize(args: argparse.Namespace) -> None:
    from pipelines.prompts import read_prompt_file
    from pipelines.quantize import DEFAULT_BF16_FALLBACK, DEFAULT_CALIBRATION_PROMPTS, quantize_checkpoint

    prompts = DEFAULT_CALIBRATION_PROMPTS
    if args.calib_prompts:
        prompts = read_prompt_file(Path(args.calib_prompts))
    ignore = (
        DEFAULT_BF16_FALLBACK if args.keep_bf16 is None else tuple(filter(None, args.keep_bf16.split(",")))
    )
    out = quantize_checkpoint(
        args.model, Path(args.out), prompts, ignore, steps=args.steps, size=args.size, device=args.device
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
    if args.no_auth:
        print(
            f"warning: serving on {args.host}:{args.port} without sign-in (--no-auth): anyone who can reach "
            "this port can use the model on this machine",
            file=sys.stderr,
        )
    return accounts


def cmd_ui(args: argparse.Namespace) -> None:
    accounts = ui_accounts(args)
    from ui.app import serve

    limits = {
        "max_work": args.max_work,
        "time_limit_s": args.time_limit,
        "queue_size": args.queue_size,
        "jobs_per_client": args.jobs_per_client,
        "keep_images_minutes": args.keep_images,
    }
    print(f"loading {args.model or 'the embedded default model'} ...", file=sys.stderr)
    demo, applied = serve(
        args.model, args.host, args.port, args.variant, args.device, args.dtype, limits, accounts or None
    )
    print(_serving_message(args.host, demo.server_port, len(accounts), applied), flush=True)
    demo.block_thread()


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except QwenImageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
