"""Drive the two variant workers over a share of the prompt x seed pairs, in ABBA order.

Each variant runs in its own `qwen_image_fusion.eval.worker` process (the pipeline loads once per worker); the
pairs alternate which side generates first (pair 0: a then b, pair 1: b then a, ...) so that warm-up and drift
do not favour one side. Metrics are computed here, as each pair completes.
"""

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from PIL import Image

from qwen_image_fusion.eval.metrics import Lpips, compare, decode_png, diff_heatmap
from qwen_image_fusion.eval.variants import VariantSpec
from qwen_image_fusion.models.errors import QwenImageError
from qwen_image_fusion.pipelines.requests import Request, as_requests

SLOTS = ("a", "b")


class WorkerCrash(RuntimeError):
    """A worker died or failed internally (its traceback is on stderr)."""


@dataclass(frozen=True)
class Job:
    """One prompt x seed pair; `index` is its place in the whole run (all ranks); `images` the input image
    files of an edit request; `init_image`, `mask` and `strength` those of an img2img or inpainting one;
    `control`, `control_mode`, `control_scale` and `control_mask` those of a ControlNet one."""

    index: int
    prompt_index: int
    prompt: str
    seed: int
    images: tuple[str, ...] = ()
    init_image: str | None = None
    mask: str | None = None
    strength: float | None = None
    control: tuple[str, ...] = ()
    control_mode: str | None = None
    control_scale: float | None = None
    control_mask: str | None = None

    @property
    def id(self) -> str:
        return f"p{self.prompt_index:03d}-s{self.seed}"


@dataclass(frozen=True)
class Settings:
    """Generation arguments shared by both sides; None means the pipeline default."""

    width: int | None = None
    height: int | None = None
    steps: int | None = None
    negative_prompt: str | None = None
    true_cfg_scale: float = 4.0


def make_jobs(prompts: list[str] | list[Request], seeds: list[int]) -> list[Job]:
    requests = as_requests(prompts)
    pairs = [(p, s) for p in range(len(requests)) for s in seeds]
    return [_job(i, requests[p], p, s) for i, (p, s) in enumerate(pairs)]


def _job(index: int, request: Request, prompt_index: int, seed: int) -> Job:
    def path(value: Path | None) -> str | None:
        return None if value is None else str(value)

    images = tuple(map(str, request.images))
    start = (path(request.init_image), path(request.mask), request.strength)
    control = (
        tuple(map(str, request.control)),
        request.control_mode,
        request.control_scale,
        path(request.control_mask),
    )
    return Job(index, prompt_index, request.prompt, seed, images, *start, *control)


def shard(jobs: list[Job], rank: int, world: int) -> list[Job]:
    """Round-robin share of one rank: jobs rank, rank+world, ..."""
    return jobs[rank::world]


class Worker:
    """A `python -m qwen_image_fusion.eval.worker` subprocess for one side of the comparison."""

    def __init__(self, slot: str, spec: VariantSpec, model: str | None, env: dict[str, str]):
        self.slot, self.spec = slot, spec
        command = [sys.executable, "-m", "qwen_image_fusion.eval.worker", "--variant", spec.name]
        flags = {"--model": model, "--device": spec.device, "--dtype": spec.dtype, "--cache": spec.cache}
        for flag, value in flags.items():
            if value is not None:
                command += [flag, value]
        command += ["--fast-decode"] if spec.fast_decode else []
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8", env=env
        )

    def receive(self) -> dict:
        """Next reply; a reported user error raises QwenImageError, a crash WorkerCrash."""
        line = self.process.stdout.readline()
        where = f"variant {self.slot} ({self.spec.text})"
        if not line:
            status = self.process.wait()
            raise WorkerCrash(f"{where}: worker exited with status {status}; see its output above")
        message = json.loads(line)
        if message["event"] == "error":
            if message["user_error"]:
                raise QwenImageError(f"{where}: {message['error']}")
            raise WorkerCrash(f"{where}: {message['error']} (traceback above)")
        return message

    def request(self, message: dict) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_workers(
    specs: dict[str, VariantSpec], models: dict[str, str | None], env: dict[str, str]
) -> dict[str, Worker]:
    """Start both workers at once (they load in parallel)."""
    return {slot: Worker(slot, specs[slot], models[slot], env) for slot in SLOTS}


def close_workers(workers: dict[str, Worker]) -> None:
    for worker in workers.values():
        worker.close()


def image_name(job: Job, slot: str) -> str:
    return f"images/{job.id}-{slot}.png"


def generate(worker: Worker, job: Job, settings: Settings, out_dir: Path) -> dict:
    request = {
        "id": job.id,
        "prompt": job.prompt,
        "seed": job.seed,
        "width": settings.width,
        "height": settings.height,
        "steps": settings.steps,
        "negative_prompt": settings.negative_prompt,
        "true_cfg_scale": settings.true_cfg_scale,
        "images": list(job.images),
        "init_image": job.init_image,
        "mask": job.mask,
        "strength": job.strength,
        "control": list(job.control),
        "control_mode": job.control_mode,
        "control_scale": job.control_scale,
        "control_mask": job.control_mask,
        "png": str(out_dir / image_name(job, worker.slot)),
    }
    return worker.request(request)


def pair_record(
    job: Job, replies: dict[str, dict], out_dir: Path, lpips: Lpips, order: str, rank: int
) -> dict:
    """Metrics of one finished pair (and its heatmap PNG when the images differ), as a report row."""
    pngs = {slot: (out_dir / image_name(job, slot)).read_bytes() for slot in SLOTS}
    metrics = compare(pngs["a"], pngs["b"], lpips)
    diff_image = diff_gain = None
    if not metrics.identical:
        heatmap, diff_gain = diff_heatmap(decode_png(pngs["a"]), decode_png(pngs["b"]))
        diff_image = f"images/{job.id}-diff.png"
        Image.fromarray(heatmap).save(out_dir / diff_image, format="PNG")
    reply = replies["a"]
    sides = {
        slot: {
            "image": image_name(job, slot),
            **asdict(getattr(metrics, slot)),
            "seconds": replies[slot]["seconds"],
            "timings": replies[slot]["timings"],
            "cache": replies[slot].get("cache"),
            "decode": replies[slot].get("decode"),
        }
        for slot in SLOTS
    }
    return {
        "index": job.index,
        "id": job.id,
        "prompt_index": job.prompt_index,
        "prompt": job.prompt,
        "images": list(job.images),
        "init_image": job.init_image,
        "mask": job.mask,
        "control": list(job.control),
        "seed": job.seed,
        "width": reply["width"],
        "height": reply["height"],
        "steps": reply["steps"],
        "rank": rank,
        "order": order,
        **sides,
        "identical": metrics.identical,
        "png_identical": metrics.png_identical,
        "psnr_db": metrics.psnr_db,
        "ssim": metrics.ssim,
        "lpips": metrics.lpips,
        "max_abs_diff": metrics.max_abs_diff,
        "mean_abs_diff": metrics.mean_abs_diff,
        "diff_image": diff_image,
        "diff_gain": diff_gain,
    }


def run_pairs(
    jobs: list[Job],
    total: int,
    workers: dict[str, Worker],
    settings: Settings,
    out_dir: Path,
    lpips: Lpips,
    rank: int,
    log: Callable[[str], None],
) -> list[dict]:
    """Generate every job on both sides in ABBA order and measure each pair."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for local, job in enumerate(jobs):
        order = "ab" if local % 2 == 0 else "ba"
        replies = {}
        for slot in order:
            replies[slot] = generate(workers[slot], job, settings, out_dir)
            variant = workers[slot].spec.text
            log(f"pair {job.index + 1}/{total} {job.id} {slot}={variant} {replies[slot]['seconds']:.2f} s")
        record = pair_record(job, replies, out_dir, lpips, order, rank)
        log(f"pair {job.index + 1}/{total} {job.id} {describe_pair(record)}")
        records.append(record)
    return records


def describe_pair(record: dict) -> str:
    if record["identical"]:
        return "identical"
    return (
        f"PSNR {record['psnr_db']:.2f} dB, SSIM {record['ssim']:.4f}, "
        f"max |diff| {record['max_abs_diff']}, mean |diff| {record['mean_abs_diff']:.3f}"
    )


TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def worker_env(cuda_device: str | None) -> dict[str, str]:
    """The workers' environment: not part of any torchrun group, and on GPUs only this rank's GPU."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in TORCHRUN_VARIABLES and not key.startswith(("TORCHELASTIC_", "ROLE_"))
    }
    if cuda_device is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_device
    return env
