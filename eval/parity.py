"""Pixel-parity harness: generate every prompt x seed with two pipeline variants and compare the images.

    python -m qwen_image_fusion.eval.parity --a contract --b reference --prompts smoke --size 64x64 --steps 2
    python -m qwen_image_fusion.eval.parity --model EDIT_DIR --a fp8-unfused --b fp8-fused --prompts edit \\
        --expect identical
    torchrun --nproc_per_node 8 -m qwen_image_fusion.eval.parity --model DIR --a fp8-unfused --b fp8-fused \\
        --prompts diverse
    python -m qwen_image_fusion.eval.parity --model BF16_DIR --model-b FP8_DIR --a reference --b fp8-fused \\
        --expect "psnr>=30"

Each variant runs in its own worker process (qwen_image_fusion.eval.worker); pairs alternate ABBA. Under
torchrun the pairs are sharded round-robin over the ranks (gloo on CPU; nccl on GPUs, where each rank's
workers use GPU LOCAL_RANK); each rank writes shard-RANK.json and its images, rank 0 merges them into
report.json and report.html. Exit status: 0 pass (or no --expect), 1 --expect failed, 2 usage or input error,
3 a worker crashed.
"""

import argparse
import datetime
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from qwen_image_fusion.eval.expect import Term, judge, parse_expect
from qwen_image_fusion.eval.metrics import Lpips, load_lpips
from qwen_image_fusion.eval.prompts import load_requests
from qwen_image_fusion.eval.report import (
    SCHEMA,
    SCHEMA_VERSION,
    decode_pair,
    read_json,
    summarize,
    summary_lines,
    write_json,
    write_report,
)
from qwen_image_fusion.eval.runner import (
    Settings,
    WorkerCrash,
    close_workers,
    make_jobs,
    run_pairs,
    shard,
    start_workers,
    worker_env,
)
from qwen_image_fusion.eval.variants import VariantSpec, parse_variant
from qwen_image_fusion.models.errors import InputError, QwenImageError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.pipelines.images import open_input_image
from qwen_image_fusion.pipelines.limits import check_size, check_steps
from qwen_image_fusion.pipelines.requests import Request, check_requests_for
from qwen_image_fusion.pipelines.variants import AUTO, VARIANTS

VARIANT_HELP = """variants: NAME[+fast-decode][+cache:PRESET][:DEVICE[:INDEX]][:DTYPE]
  NAME    reference | contract | fp8-unfused | fp8-fused | nvfp4 | nvfp4-w4a4-unfused | nvfp4-w4a4-fused
          | auto   (see docs/API.md)
  +fast-decode  the VAE's 2D decode: approximate, compare it with the same NAME without
  PRESET  a step cache (fast | faster): approximate, compare it with the same NAME without
  DEVICE  cpu | cuda (cuda:INDEX picks a GPU; not allowed under torchrun on GPUs, where each rank
          uses GPU LOCAL_RANK); default: CUDA when available
  DTYPE   bf16 | fp32; default bf16
  e.g. contract, fp8-fused:cuda, reference:cpu:fp32, contract:cuda:1:bf16, fp8-fused+cache:fast
expect: 'identical' or comma-separated METRIC OP NUMBER terms that every pair must meet
  METRIC  psnr (dB) | ssim | lpips | max_abs | mean_abs;  OP  >= > <= < ==
  e.g. --expect identical, --expect "psnr>=35,ssim>=0.98"
exit status: 0 pass (or no --expect), 1 expectation failed, 2 usage/input error, 3 worker crashed
report.json schema: eval/README.md"""


@dataclass(frozen=True)
class Config:
    """A validated command line."""

    models: dict[str, str | None]  # checkpoint per side; None: the embedded default
    prompts: list[Request]  # prompts, with input images for an edit set
    prompt_source: str
    seeds: list[int]
    specs: dict[str, VariantSpec]
    settings: Settings
    out_dir: Path
    expect_text: str | None
    expect: list[Term] | None
    lpips_weights: str | None
    argv: list[str]


@dataclass(frozen=True)
class Rank:
    """Where this process sits in a torchrun group (rank 0 of 1 when run directly)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    cuda_device: str | None = None  # the GPU (CUDA_VISIBLE_DEVICES entry) this rank's workers use


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_image_fusion.eval.parity",
        description="Compare two pipeline variants image by image over a prompt set.",
        epilog=VARIANT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", metavar="DIR", help="diffusers-layout checkpoint directory (default: the embedded default)"
    )
    parser.add_argument("--model-a", metavar="DIR", help="checkpoint of side a only (default: --model)")
    parser.add_argument(
        "--model-b", metavar="DIR", help="checkpoint of side b only, e.g. an FP8 export vs its BF16 source"
    )
    parser.add_argument(
        "--prompts",
        default="smoke",
        metavar="FILE|SET",
        help="prompt file, or an edit set (.jsonl: image + instruction pairs, or start images and masks), "
        "or a built-in set: smoke, diverse; edit, edit-plus (drawn images and instructions, for Edit "
        "checkpoints); img2img, inpaint (drawn start images and masks, for Qwen-Image text-to-image ones); "
        "control, control-inpaint (ControlNet checkpoints); edit-inpaint (a one-image Edit checkpoint)",
    )
    parser.add_argument("--a", required=True, metavar="VARIANT", help="variant of side a (grammar below)")
    parser.add_argument("--b", required=True, metavar="VARIANT", help="variant of side b (grammar below)")
    parser.add_argument("--seeds", default="0", metavar="LIST", help="comma-separated seeds (default 0)")
    parser.add_argument("--steps", type=int, metavar="N", help="denoising steps (default: the pipeline's)")
    parser.add_argument(
        "--size", metavar="WxH", help="WxH, multiples of 16 (2x the VAE scale) (default: the pipeline's)"
    )
    parser.add_argument(
        "--negative-prompt", metavar="TEXT", help="enables true CFG when --true-cfg-scale > 1"
    )
    parser.add_argument(
        "--true-cfg-scale",
        "--cfg-scale",
        dest="cfg_scale",
        type=float,
        default=4.0,
        metavar="S",
        help="true CFG scale (default 4.0), as in `qwen-image generate`",
    )
    parser.add_argument(
        "--out", default="out/parity", metavar="DIR", help="output directory (default out/parity)"
    )
    parser.add_argument(
        "--expect", metavar="SPEC", help="verdict to reach: identical, or e.g. 'psnr>=35,ssim>=0.98'"
    )
    parser.add_argument(
        "--lpips-weights",
        metavar="PATH",
        help="torchvision AlexNet checkpoint (default: the torch hub cache)",
    )
    return parser


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(item) for item in text.split(",")]
    except ValueError:
        raise InputError(f"bad --seeds {text!r}: use comma-separated integers, e.g. 0,1,2") from None
    if any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        raise InputError(f"bad --seeds {text!r}: seeds must be distinct and non-negative")
    return seeds


def parse_size(text: str | None) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    width, sep, height = text.lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit()):
        raise InputError(f"bad --size {text!r}: use WIDTHxHEIGHT, e.g. 64x64")
    return int(width), int(height)


def make_config(args: argparse.Namespace, argv: list[str]) -> Config:
    """Validate everything that can be checked before any worker starts. Raises InputError."""
    models = {"a": args.model_a or args.model, "b": args.model_b or args.model}
    for model in models.values():
        if model is not None and not Path(model).is_dir():
            raise InputError(f"model directory not found: {model}")
    if args.steps is not None:
        check_steps(args.steps)
    width, height = parse_size(args.size)
    prompts, seeds = load_requests(args.prompts), parse_seeds(args.seeds)
    for model in models.values():
        spec = inspect_checkpoint(model)
        if width is not None:
            check_size(width, height, spec.size_multiple)
        check_requests_for(prompts, spec)
    for request in prompts:
        for path in request.files:
            open_input_image(path)
    expect = parse_expect(args.expect) if args.expect is not None else None

    known = (*VARIANTS, AUTO)
    return Config(
        models=models,
        prompts=prompts,
        prompt_source=args.prompts,
        seeds=seeds,
        specs={"a": parse_variant(args.a, known), "b": parse_variant(args.b, known)},
        settings=Settings(width, height, args.steps, args.negative_prompt, args.cfg_scale),
        out_dir=Path(args.out),
        expect_text=args.expect,
        expect=expect,
        lpips_weights=args.lpips_weights,
        argv=argv,
    )


def join_torchrun(config: Config) -> Rank:
    """Join the torchrun group when WORLD_SIZE > 1 (gloo on CPU, nccl with GPUs)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Rank()
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    cuda_device = None
    if torch.cuda.is_available():
        if any(spec.device and spec.device.startswith("cuda:") for spec in config.specs.values()):
            raise InputError("under torchrun each rank uses GPU LOCAL_RANK: write 'cuda', not 'cuda:INDEX'")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        cuda_device = gpus[local_rank]
        torch.cuda.set_device(local_rank)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device_id = torch.device("cuda", local_rank) if backend == "nccl" else None  # NCCL need not guess it
    dist.init_process_group(backend, timeout=datetime.timedelta(hours=2), device_id=device_id)
    return Rank(dist.get_rank(), world, local_rank, cuda_device)


def barrier(rank: Rank) -> None:
    if rank.world > 1:
        import torch.distributed as dist

        dist.barrier()


def leave_torchrun(rank: Rank) -> None:
    if rank.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def require_lpips(config: Config, lpips: Lpips) -> None:
    if config.expect and any(term.metric == "lpips" for term in config.expect) and not lpips.available:
        raise InputError(f"--expect uses lpips but LPIPS is unavailable: {lpips.reason}")


def lpips_status(lpips: Lpips) -> dict:
    return {"available": lpips.available, "reason": lpips.reason, "net": "alex", "weights": lpips.weights}


def run_rank(config: Config, rank: Rank) -> dict:
    """This rank's share of the pairs: start both workers, generate, measure; returns the shard."""
    jobs = make_jobs(config.prompts, config.seeds)
    prefix = f"[rank {rank.rank}] " if rank.world > 1 else ""

    def log(line: str) -> None:
        print(prefix + line, file=sys.stderr, flush=True)

    lpips = load_lpips(config.lpips_weights)
    require_lpips(config, lpips)
    workers = start_workers(config.specs, config.models, worker_env(rank.cuda_device))
    try:
        ready = {slot: worker.receive() for slot, worker in workers.items()}
        for slot, info in ready.items():
            log(
                f"{slot}={config.specs[slot].text}: {info['device']} {info['dtype']}, loaded in "
                f"{info['load_seconds']:.1f} s; {info['fusion_summary']}"
            )
        given, defaults = config.settings, ready["a"]  # both sides get a's defaults, so the sizes match
        settings = replace(
            given,
            width=given.width or defaults["width"],
            height=given.height or defaults["height"],
            steps=given.steps or defaults["steps"],
        )
        lpips = lpips.unavailable_for_size(settings.width, settings.height)
        require_lpips(config, lpips)
        pairs = run_pairs(
            shard(jobs, rank.rank, rank.world),
            len(jobs),
            workers,
            settings,
            config.out_dir,
            lpips,
            rank.rank,
            log,
        )
    finally:
        close_workers(workers)
    for info in ready.values():
        info.pop("event")
        info.update(rank=rank.rank, cuda_visible_devices=rank.cuda_device)
    return {
        "rank": rank.rank,
        "world_size": rank.world,
        "settings": asdict(settings),
        "workers": ready,
        "lpips": lpips_status(lpips),
        "pairs": pairs,
    }


def merge(config: Config, world: int) -> dict:
    """Rank 0: the report from every rank's shard file."""
    shards = [read_json(config.out_dir / f"shard-{r}.json") for r in range(world)]
    pairs = sorted((decode_pair(p) for s in shards for p in s["pairs"]), key=lambda p: p["index"])
    lpips = next((s["lpips"] for s in shards if not s["lpips"]["available"]), shards[0]["lpips"])
    report = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": ["python", "-m", "qwen_image_fusion.eval.parity", *config.argv],
        "model": {slot: shards[0]["workers"][slot]["model_name"] for slot in "ab"},
        "prompts": {"source": config.prompt_source, "count": len(config.prompts)},
        "settings": {**shards[0]["settings"], "seeds": config.seeds},
        "world_size": world,
        "variants": {
            slot: {"spec": config.specs[slot].text, "workers": [s["workers"][slot] for s in shards]}
            for slot in "ab"
        },
        "lpips": lpips,
        "pairs": pairs,
        "summary": summarize(pairs),
        "expect": {"spec": config.expect_text, "passed": None, "line": None, "failures": []},
    }
    if config.expect is not None:
        verdict = judge(config.expect, pairs)
        report["expect"].update(passed=verdict.passed, line=verdict.line, failures=verdict.failures)
    return report


def run(config: Config, rank: Rank) -> int:
    shard_path = config.out_dir / f"shard-{rank.rank}.json"
    config.out_dir.mkdir(parents=True, exist_ok=True)
    shard_path.unlink(missing_ok=True)
    write_json(run_rank(config, rank), shard_path)
    barrier(rank)
    if rank.rank != 0:
        return 0
    report = merge(config, rank.world)
    write_report(report, config.out_dir)
    print(f"report: {config.out_dir / 'report.html'} (data: {config.out_dir / 'report.json'})")
    for line in summary_lines(report):
        print(line)
    if config.expect is None:
        return 0
    print(report["expect"]["line"])
    return 0 if report["expect"]["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    rank = Rank()
    try:
        config = make_config(args, argv)
        rank = join_torchrun(config)
        return run(config, rank)
    except QwenImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WorkerCrash as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    finally:
        leave_torchrun(rank)


if __name__ == "__main__":
    sys.exit(main())
