"""Quality of every lossy option on the trained embedded default (issue 51, part 1), and its table.

Each option's images are compared with the exact image of the same prompt and seed, over the eval prompt
sets (`eval/prompts`: smoke and diverse) and a few seeds, with the parity harness's own pieces: its worker
processes (`qwen_image_fusion.eval.worker`, one pipeline per side), its request and its pair record
(`eval.runner.generate` and `pair_record`: PSNR, SSIM and LPIPS from `eval.metrics`). Each side is one
worker loaded once, and the exact side is generated once per prompt and seed and compared with every
option (a parity run per option would generate it again each time); a pair row is what
`python -m qwen_image_fusion.eval.parity --a EXACT --b OPTION` writes for the same pair.

    python -m bench.quality_table                        # quantize, generate, measure; raw files and table
    python -m bench.quality_table --seeds 0 --sets smoke  # a quick look
    python -m bench.quality_table --table                # only the table, from the published raw files
    python -m bench.quality_table --options nvfp4,nvfp4-every-block \
        --out bench/results/2026-12-06-cpu-quality-nvfp4  # the NVFP4 rows

The FP8 and NVFP4 checkpoints come from `qwen-image quantize` of the embedded default (its built-in
calibration prompts, the model's steps and size, seed 0): FP8 with the default BF16 fallback list,
`--fp8-modulation`, and a `--keep-bf16` list without `*.img_mlp.net.2`; NVFP4 (`--format nvfp4`) with its
default rules and with only the linears outside the blocks kept. Raw files (`--out`): `machine.txt`, one
`<option>.json` per option (settings, workers, every pair, its summary), `summary.json`, `table.md`. Images,
checkpoints and logs go to `--work` (not committed). Interrupted runs resume: a generated image with its
reply is kept.
"""

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qwen_image_fusion.eval.metrics import Lpips, load_lpips
from qwen_image_fusion.eval.prompts import load_requests
from qwen_image_fusion.eval.report import decode_pair, read_json, write_json
from qwen_image_fusion.eval.runner import Job, Settings, Worker, generate, image_name, make_jobs, pair_record
from qwen_image_fusion.eval.variants import parse_variant
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.pipelines.variants import AUTO, VARIANTS

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "2026-12-05-cpu-quality"
# every folder the published table reads, in order (the NVFP4 rows were measured a session later)
RESULT_FOLDERS = (DEFAULT_OUT, REPO / "bench" / "results" / "2026-12-06-cpu-quality-nvfp4")
DEFAULT_WORK = REPO / "out" / "quality"
SCHEMA = "qwen-image-fusion/quality-option"
PROMPT_SETS = ("smoke", "diverse")
SEEDS = (0, 1)  # the published run's (a third seed did not fit the shared CPU's time)
NET2 = "*.img_mlp.net.2"


@dataclass(frozen=True)
class Side:
    """One worker: a parity variant spec on a checkpoint (None: the embedded default's BF16 weights)."""

    name: str
    variant: str
    checkpoint: str | None = None  # a key of `checkpoints()`


@dataclass(frozen=True)
class LossyOption:
    """A lossy option measured against an exact side of the same dtype."""

    name: str
    title: str
    candidate: Side
    exact: Side


EXACT_BF16 = Side("exact-bf16", "contract:cpu:bf16")  # this CPU's default (native BF16), asked explicitly
EXACT_FP32 = Side("exact-fp32", "reference:cpu:fp32")  # what a CPU without native BF16 runs by default
FP8 = Side("fp8", "fp8-fused:cpu:bf16", "fp8")
FP8_MODULATION = Side("fp8-modulation", "fp8-fused:cpu:bf16", "fp8-modulation")
FP8_NET2 = Side("fp8-net2", "fp8-fused:cpu:bf16", "fp8-net2")
NVFP4 = Side("nvfp4", "nvfp4:cpu:bf16", "nvfp4")
NVFP4_EVERY_BLOCK = Side("nvfp4-every-block", "nvfp4:cpu:bf16", "nvfp4-every-block")
OPTIONS = (
    LossyOption(
        "cache-fast", "step cache `fast`", Side("cache-fast", "contract+cache:fast:cpu:bf16"), EXACT_BF16
    ),
    LossyOption(
        "cache-faster",
        "step cache `faster`",
        Side("cache-faster", "contract+cache:faster:cpu:bf16"),
        EXACT_BF16,
    ),
    LossyOption(
        "fast-decode-bf16",
        "fast decode, BF16",
        Side("fast-decode-bf16", "contract+fast-decode:cpu:bf16"),
        EXACT_BF16,
    ),
    LossyOption(
        "fast-decode-fp32",
        "fast decode, FP32",
        Side("fast-decode-fp32", "reference+fast-decode:cpu:fp32"),
        EXACT_FP32,
    ),
    LossyOption("fp8", "FP8 (default BF16 fallback list)", FP8, EXACT_BF16),
    LossyOption("fp8-modulation", "FP8 + FP8 modulation", FP8_MODULATION, EXACT_BF16),
    LossyOption("fp8-net2", "FP8 + `img_mlp.net.2` in FP8", FP8_NET2, EXACT_BF16),
    # what each FP8 choice adds on top of FP8 with the default list (no extra images: both sides are above)
    LossyOption("fp8-modulation-over-fp8", "FP8 modulation, over FP8", FP8_MODULATION, FP8),
    LossyOption("fp8-net2-over-fp8", "`img_mlp.net.2` in FP8, over FP8", FP8_NET2, FP8),
    LossyOption(
        "nvfp4",
        "NVFP4 weights (default rules: first and last two blocks in BF16, here 2 of 6 blocks in NVFP4)",
        NVFP4,
        EXACT_BF16,
    ),
    LossyOption("nvfp4-every-block", "NVFP4 weights in every block", NVFP4_EVERY_BLOCK, EXACT_BF16),
    # NVFP4 against FP8 with its default list (no extra images: both sides are above)
    LossyOption("nvfp4-against-fp8", "NVFP4 (default rules), against FP8", NVFP4, FP8),
    LossyOption("nvfp4-every-block-against-fp8", "NVFP4 in every block, against FP8", NVFP4_EVERY_BLOCK, FP8),
)


def checkpoints() -> dict[str, list[str]]:
    """`qwen-image quantize` arguments (after --out) of each quantized checkpoint of the embedded default."""
    from qwen_image_fusion.models.qwen_image.model import QUANTIZATION

    keep = ",".join(glob for glob in QUANTIZATION.bf16_fallback if glob != NET2)
    outside = ",".join(QUANTIZATION.outside_blocks)
    return {
        "fp8": [],
        "fp8-modulation": ["--fp8-modulation"],
        "fp8-net2": ["--keep-bf16", keep],
        "nvfp4": ["--format", "nvfp4"],
        "nvfp4-every-block": ["--format", "nvfp4", "--keep-bf16", outside],
    }


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_text(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def machine_record() -> str:
    """The CPU (lscpu model, avx512_bf16 / avx2), software and the commit that ran (marked if dirty)."""
    import diffusers
    import torch

    lscpu = run_text(["lscpu"])
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?")
    flags = next(
        (line.split(":", 1)[1].split() for line in lscpu.splitlines() if line.startswith("Flags")), []
    )
    commit = run_text(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    # results being written are data, not code: any other change, tracked or not, marks the run uncommitted
    dirty = run_text(["git", "-C", str(REPO), "status", "--porcelain", "--", ".", ":!bench/results"])
    return "\n".join(
        [
            f"date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
            f"cpu: {model}, {os.cpu_count()} cores visible (shared with other work: seconds are not timings)",
            f"avx512_bf16: {yes_no('avx512_bf16' in flags)}; avx2: {yes_no('avx2' in flags)}",
            f"torch {torch.__version__} (cpu capability {torch.backends.cpu.get_cpu_capability()}), "
            f"diffusers {diffusers.__version__}, python {platform.python_version()}",
            f"commit: {commit}" + (" (uncommitted: the tree had changes)" if dirty else ""),
            f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        ]
    )


def quantize_command(out: Path, extra: list[str]) -> list[str]:
    shown = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    return ["qwen-image", "quantize", "--out", str(shown), "--device", "cpu", *extra]


def build_checkpoints(work: Path, needed: set[str]) -> dict[str, dict]:
    """Each FP8 checkpoint `needed`, made by `qwen-image quantize` unless already there."""
    made = {}
    for name, extra in checkpoints().items():
        if name not in needed:
            continue
        directory = work / "checkpoints" / name
        command = quantize_command(directory, extra)
        if not (directory / "model_index.json").is_file():
            shutil.rmtree(directory, ignore_errors=True)
            log(f"quantizing {name}: {' '.join(command)}")
            start = time.perf_counter()
            with (work / f"quantize-{name}.log").open("w") as out:
                argv = [sys.executable, "-m", "qwen_image_fusion.ui.cli", *command[1:3], str(directory)]
                argv += command[4:]
                subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=True)
            log(f"quantized {name} in {time.perf_counter() - start:.0f} s")
        config = json.loads((directory / "transformer" / "config.json").read_text())
        quantization = config["quantization_config"]
        made[name] = {
            "directory": str(directory.relative_to(REPO))
            if directory.is_relative_to(REPO)
            else str(directory),
            "command": " ".join(command),
            "ignore": quantization.get("ignore"),
            "weight_only": {k: v for k, v in quantization.items() if "weight_only" in k},
            "transformer_sha256": {
                file.name: hashlib.sha256(file.read_bytes()).hexdigest()
                for file in sorted((directory / "transformer").glob("*.safetensors"))
            },
        }
    return made


@dataclass(frozen=True)
class Folders:
    """The work folders of one step count (so a quick look with fewer steps is never resumed from)."""

    work: Path
    steps: int

    def side(self, side: Side, prompt_set: str) -> Path:
        """A side's images of a prompt set, each beside its worker reply."""
        return self.work / "images" / f"{self.steps}-steps" / side.name / prompt_set

    def reply(self, side: Side, prompt_set: str, job: Job) -> Path:
        return self.side(side, prompt_set) / f"{job.id}.reply.json"

    def pairs(self, option: "LossyOption", prompt_set: str) -> Path:
        """An option's pairs in the parity layout (images/ID-a.png, ID-b.png, ID-diff.png)."""
        return self.work / "pairs" / f"{self.steps}-steps" / option.name / prompt_set


class Sides:
    """The workers of every side, started once, each generating into its own folder (resumable)."""

    def __init__(self, sides: list[Side], made: dict[str, dict], folders: Folders) -> None:
        known = (*VARIANTS, AUTO)
        self.folders = folders
        self.workers: dict[str, Worker] = {}
        self.ready: dict[str, dict] = {}
        for side in sides:
            model = str(REPO / made[side.checkpoint]["directory"]) if side.checkpoint else None
            self.workers[side.name] = Worker("a", parse_variant(side.variant, known), model, dict(os.environ))
        for side in sides:
            self.ready[side.name] = self.workers[side.name].receive()
            info = self.ready[side.name]
            log(f"{side.name} ({side.variant}): {info['dtype']}, loaded in {info['load_seconds']:.1f} s")

    def generate(self, side: Side, prompt_set: str, job: Job, settings: Settings) -> dict:
        """The side's image of `job` (generated unless a previous run left it) and its worker reply."""
        saved = self.folders.reply(side, prompt_set, job)
        if saved.is_file():
            return json.loads(saved.read_text())
        out_dir = self.folders.side(side, prompt_set)
        (out_dir / "images").mkdir(parents=True, exist_ok=True)
        reply = generate(self.workers[side.name], job, settings, out_dir)
        saved.write_text(json.dumps(reply))
        return reply

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def skipped_steps(cache: dict | None) -> dict[str, float]:
    """Steps skipped per CFG branch, from the worker's reply (RunInfo.cache, a CacheReport as a dict: one
    count per image row, here one image); {} without a cache. The 2026-12-05 raw files were written by the
    code before the report was structured and hold its text; their `skipped` rows were read from it."""
    if not cache:
        return {}
    return {branch: sum(counts) / len(counts) for branch, counts in cache["skipped"].items()}


def nearest_rank(values: list[float], percent: float) -> float:
    """The nearest-rank percentile (no interpolation, so an infinite PSNR stays a value)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(percent / 100 * len(ordered)) - 1, 0)]


def spread(values: list[float]) -> dict | None:
    """min, p10, median, p90, max (nearest rank) and the mean of the finite values."""
    if not values:
        return None
    finite = [v for v in values if math.isfinite(v)]
    return {
        "min": min(values),
        "p10": nearest_rank(values, 10),
        "median": statistics.median(values),
        "p90": nearest_rank(values, 90),
        "max": max(values),
        "finite_mean": statistics.fmean(finite) if finite else None,
        "count": len(values),
    }


def summarize_pairs(pairs: list[dict]) -> dict:
    """Counts and spreads of one option's pairs (PSNR, SSIM, LPIPS, differences, steps skipped)."""
    lpips = [p["lpips"] for p in pairs if p["lpips"] is not None]
    order = {"positive": 0, "negative": 1}
    branches = sorted({branch for p in pairs for branch in p["skipped"]}, key=lambda b: (order.get(b, 2), b))
    return {
        "pairs": len(pairs),
        "identical": sum(p["identical"] for p in pairs),
        "below_30_db": sum(p["psnr_db"] < 30 for p in pairs),
        "below_25_db": sum(p["psnr_db"] < 25 for p in pairs),
        "psnr_db": spread([p["psnr_db"] for p in pairs]),
        "ssim": spread([p["ssim"] for p in pairs]),
        "lpips": spread(lpips),
        "max_abs_diff": spread([p["max_abs_diff"] for p in pairs]),
        "mean_abs_diff": spread([p["mean_abs_diff"] for p in pairs]),
        "skipped_steps": {b: spread([p["skipped"][b] for p in pairs if b in p["skipped"]]) for b in branches},
    }


def pair_row(prompt_set: str, record: dict) -> dict:
    """The parity pair record, tagged with its prompt set and the steps the candidate's cache skipped."""
    return {"prompt_set": prompt_set, **record, "skipped": skipped_steps(record["b"]["cache"])}


def compare_pair(
    folders: Folders,
    option: LossyOption,
    prompt_set: str,
    job: Job,
    replies: dict[str, dict],
    lpips: Lpips,
) -> dict:
    """Link the exact image beside the candidate's and measure them with the parity harness's record."""
    out_dir = folders.pairs(option, prompt_set)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    for slot, side in (("a", option.exact), ("b", option.candidate)):
        source = folders.side(side, prompt_set) / image_name(job, "a")
        target = out_dir / image_name(job, slot)
        target.unlink(missing_ok=True)
        os.link(source, target)
    return pair_record(job, replies, out_dir, lpips, "ab", 0)


def measure(args: argparse.Namespace) -> None:
    """Quantize, generate every side, compare, and write the raw files."""
    options = [o for o in OPTIONS if o.name in args.options]
    sides = list({s.name: s for o in options for s in (o.exact, o.candidate)}.values())
    work, out = args.work, args.out
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "machine.txt").write_text(machine_record() + "\n")
    made = build_checkpoints(work, {s.checkpoint for s in sides if s.checkpoint})
    lpips = load_lpips(None)
    defaults = inspect_checkpoint(None).defaults  # the embedded default's size and steps
    settings = Settings(
        defaults.width, defaults.height, args.steps or defaults.num_inference_steps, None, 4.0
    )
    folders = Folders(work, settings.steps)
    requests = {name: load_requests(name) for name in args.sets}
    jobs = [
        (prompt_set, job)
        for seed in args.seeds
        for prompt_set in args.sets
        for job in make_jobs(requests[prompt_set], [seed])
    ]
    workers = Sides(sides, made, folders)
    rows: dict[str, list[dict]] = {o.name: [] for o in options}
    start = time.perf_counter()
    try:
        for done, (prompt_set, job) in enumerate(jobs, 1):
            replies = {side.name: workers.generate(side, prompt_set, job, settings) for side in sides}
            for option in options:
                pair = {"a": replies[option.exact.name], "b": replies[option.candidate.name]}
                rows[option.name].append(
                    pair_row(prompt_set, compare_pair(folders, option, prompt_set, job, pair, lpips))
                )
            elapsed = time.perf_counter() - start
            worst = min(rows.items(), key=lambda kv: kv[1][-1]["psnr_db"])
            eta = elapsed / done * (len(jobs) - done)
            log(
                f"[{done}/{len(jobs)}] {prompt_set} {job.id}: "
                + ", ".join(f"{name} {r[-1]['psnr_db']:.1f}" for name, r in rows.items())
                + f" dB (lowest {worst[0]}); {elapsed / 60:.1f} min, ETA {eta / 60:.0f} min"
            )
    finally:
        workers.close()
    lpips_status = {"available": lpips.available, "reason": lpips.reason, "net": "alex"}
    run_settings = {
        "width": settings.width,
        "height": settings.height,
        "steps": settings.steps,
        "negative_prompt": "the model's default (' ')",
        "true_cfg_scale": settings.true_cfg_scale,
        "seeds": list(args.seeds),
        "prompt_sets": {name: len(requests[name]) for name in args.sets},
        "device": "cpu",
    }
    summary = {"command": sys.argv, "settings": run_settings, "lpips": lpips_status, "options": {}}
    for option in options:
        pairs = rows[option.name]
        report = {
            "schema": SCHEMA,
            "schema_version": 1,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": sys.argv,
            "option": option.name,
            "title": option.title,
            "exact": side_record(option.exact, made, workers.ready),
            "candidate": side_record(option.candidate, made, workers.ready),
            "settings": run_settings,
            "lpips": lpips_status,
            "summary": {
                "all": summarize_pairs(pairs),
                **{s: summarize_pairs([p for p in pairs if p["prompt_set"] == s]) for s in args.sets},
            },
            "pairs": pairs,
        }
        write_json(report, out / f"{option.name}.json")
        summary["options"][option.name] = {"title": option.title, **report["summary"]}
    write_json(summary, out / "summary.json")
    log(
        f"raw files in {out}; {len(jobs)} prompt x seed pairs in {(time.perf_counter() - start) / 60:.1f} min"
    )


def number(value: float, digits: int) -> str:
    return "identical" if value == math.inf else f"{value:.{digits}f}"


def five(spread_: dict | None, digits: int) -> str:
    if spread_ is None:
        return "unavailable"
    keys = ("min", "p10", "median", "p90", "max")
    return " / ".join(
        ("**" if k == "min" else "") + number(spread_[k], digits) + ("**" if k == "min" else "") for k in keys
    )


def skipped_cell(summary: dict, steps: int) -> str:
    branches = summary["skipped_steps"]
    if not branches:
        return "-"
    cells = []
    for branch, s in branches.items():
        cells.append(
            f"{branch} {s['min']:g} / {s['median']:g} / {s['max']:g} (mean {s['finite_mean']:.1f}) of {steps}"
        )
    return "; ".join(cells)


def table(outs: tuple[Path, ...]) -> str:
    """The BENCHMARKS.md table, from the raw files in `outs` only (an option's from the first that has it)."""
    lines = [
        "| option | runs (parity variant, checkpoint) | against | pairs | identical | below 30 / 25 dB "
        "| PSNR dB min / p10 / median / p90 / max | SSIM min / p10 / median / p90 / max | LPIPS "
        "| steps skipped per CFG branch: min / median / max |",
        "|---|---|---|---:|---:|---:|---|---|---|---|",
    ]
    commands: dict[str, str] = {}
    for option in OPTIONS:
        path = next(
            (out / f"{option.name}.json" for out in outs if (out / f"{option.name}.json").is_file()), None
        )
        if path is None:
            continue
        report = read_json(path)
        pairs = [decode_pair(p) for p in report["pairs"]]
        summary = summarize_pairs(pairs)  # re-derived from the pair rows, not copied from the summary
        if not equal(summary, report["summary"]["all"]):
            raise ValueError(f"{path}: its summary does not follow from its pairs")
        for side in (report["exact"], report["candidate"]):
            if isinstance(side["checkpoint"], dict):
                commands[side["checkpoint"]["name"]] = side["checkpoint"]["command"]
        lpips = "unavailable" if summary["lpips"] is None else five(summary["lpips"], 3)
        lines.append(
            f"| {report['title']} | {side_text(report['candidate'])} | {side_text(report['exact'])} "
            f"| {summary['pairs']} | {summary['identical']} "
            f"| {summary['below_30_db']} / {summary['below_25_db']} "
            f"| {five(summary['psnr_db'], 2)} | {five(summary['ssim'], 4)} | {lpips} "
            f"| {skipped_cell(summary, report['settings']['steps'])} |"
        )
    lines.append("")
    lines += [f"- `{name}`: `{command}`" for name, command in commands.items()]
    return "\n".join(lines) + "\n"


def side_text(side: dict) -> str:
    """A side as the table names it: its parity variant, and its checkpoint unless the embedded default."""
    checkpoint = side["checkpoint"]
    return f"`{side['variant']}`" + ("" if isinstance(checkpoint, str) else f" on `{checkpoint['name']}`")


def side_record(side: Side, made: dict[str, dict], ready: dict[str, dict]) -> dict:
    """A side in a raw file: variant, checkpoint (how it was made) and its worker's ready message."""
    checkpoint = {"name": side.checkpoint, **made[side.checkpoint]} if side.checkpoint else "embedded-default"
    return {"variant": side.variant, "checkpoint": checkpoint, "worker": ready[side.name]}


def equal(a: object, b: object) -> bool:
    """Summaries equal, with JSON's "inf" strings read as floats."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(b, str) and isinstance(a, float):
        return a == float(b)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=1e-12)
    return a == b


def crosscheck(report_path: Path, option: str, prompt_set: str, out: Path) -> dict:
    """Compare a parity run's report with the same pairs of an option's raw file: both sides' pixel hashes,
    the metrics and the cache line must be equal (the exact side, generated once here, included)."""
    report = read_json(report_path)
    rows = {p["id"]: p for p in read_json(out / f"{option}.json")["pairs"] if p["prompt_set"] == prompt_set}
    keys = ("psnr_db", "ssim", "max_abs_diff", "mean_abs_diff")
    pairs = []
    for pair in report["pairs"]:
        row = rows[pair["id"]]
        pairs.append(
            {
                "id": pair["id"],
                "exact_pixels_equal": pair["a"]["pixel_sha256"] == row["a"]["pixel_sha256"],
                "option_pixels_equal": pair["b"]["pixel_sha256"] == row["b"]["pixel_sha256"],
                "metrics_equal": all(pair[k] == row[k] for k in keys),
                "cache_equal": pair["b"]["cache"] == row["b"]["cache"],
            }
        )
    equal_all = all(all(v for k, v in p.items() if k != "id") for p in pairs)
    return {
        "parity_command": report["command"],
        "option": option,
        "prompt_set": prompt_set,
        "pairs": pairs,
        "all_equal": equal_all,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.quality_table", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"raw files (default: {DEFAULT_OUT}; --table alone: every published folder)",
    )
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="images, checkpoints (%(default)s)")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=list(SEEDS))
    parser.add_argument("--sets", type=lambda s: s.split(","), default=list(PROMPT_SETS))
    parser.add_argument("--steps", type=int, help="denoising steps (default: the model's, 20)")
    parser.add_argument(
        "--options", type=lambda s: s.split(","), default=[o.name for o in OPTIONS], help="comma-separated"
    )
    parser.add_argument("--table", action="store_true", help="only print the table from the raw files")
    parser.add_argument(
        "--crosscheck",
        nargs=3,
        metavar=("REPORT", "OPTION", "SET"),
        help="compare a parity report.json with OPTION's pairs of prompt SET; writes parity_crosscheck.json",
    )
    args = parser.parse_args(argv)
    if args.table and args.out is None:
        print(table(RESULT_FOLDERS))
        return 0
    args.out = args.out or DEFAULT_OUT
    if args.crosscheck:
        result = crosscheck(Path(args.crosscheck[0]), args.crosscheck[1], args.crosscheck[2], args.out)
        write_json(result, args.out / "parity_crosscheck.json")
        print(f"all equal: {result['all_equal']} ({len(result['pairs'])} pairs)")
        return 0 if result["all_equal"] else 1
    if not args.table:
        unknown = set(args.options) - {o.name for o in OPTIONS}
        if unknown:
            parser.error(f"unknown options {sorted(unknown)}")
        measure(args)
    text = table((args.out,))
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
