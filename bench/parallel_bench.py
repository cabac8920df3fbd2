"""Two GPUs against one on a checkpoint: seconds per image with true CFG (1 GPU vs CFG-2), batch-1 step
time with CFG off (1 GPU vs Ulysses-2), how close Ulysses-2 images are to one GPU's, FP8 fused vs
unfused under Ulysses-2, and CUDA graphs cut at collectives vs collectives captured vs eager.

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/parallel_bench.py \\
        --model CKPT --out DIR [--size 1024] [--steps 50] [--step-runs 20]
    (CPU smoke run: --device cpu --size 64 --steps 2 --step-runs 2, with no --model: the embedded model)

Every rank loads the pipeline once and switches plans in place (`set_parallel`); the one-GPU runs go on
rank 0 while the others wait. Results are written to DIR/parallel_bench.json after each phase (so a
phase that hangs still leaves the earlier ones) and printed as a table at the end. A phase that runs
past --phase-timeout seconds ends the run (collectives captured in a CUDA graph are not watched by
NCCL's timeout).
"""

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from qwen_image_fusion.eval.metrics import abs_diff, psnr
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.parallel import ParallelPlan, join_ranks

PROMPT = "a red fox in the snow, detailed fur, morning light"
NEGATIVE = " "  # true CFG on, as Qwen-Image is usually run
TARGETS = {"cfg2_seconds_per_image": 5.5, "cfg2_speedup": 1.85, "ulysses2_step_speedup": 1.6}
PEERS = {  # published figures (docs/DESIGN.md §6), 1024x1024, 50 steps, true CFG
    "SGLang diffusion, 2xH100": "185.7 ms/step, 9.88 s per image",
    "cache-dit, 2xH100, Ulysses-2 + FA3 (lossless)": "12.75 s per image",
}


class Bench:
    """The ranks' shared state: the pipeline on this rank's GPU, a gloo group to wait on, the results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        device = join_ranks(torch.device(args.device))
        self.rank = dist.get_rank()
        self.waiting = dist.new_group(backend="gloo")
        start = time.perf_counter()
        self.pipe = load_pipeline(args.model, device=device)
        self.results: dict = {
            "model": args.model,
            "size": args.size,
            "steps": args.steps,
            "step_runs": args.step_runs,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
            "load_seconds": time.perf_counter() - start,
            "variant": self.pipe.variant,
            "fusion": self.pipe.fusion_summary().splitlines()[0],
            "targets": TARGETS,
            "peers": PEERS,
        }
        self.images: dict[str, np.ndarray] = {}

    def generate(self, name: str, steps: int, cfg: bool, seed: int = 0) -> dict:
        """One image after a 2-step warm-up (graph captures); its timings, its pixels kept as `name`."""
        args = dict(width=self.args.size, height=self.args.size, negative_prompt=NEGATIVE if cfg else None)
        self.pipe.generate(PROMPT, num_inference_steps=2, seed=seed + 1, **args)
        image = self.pipe.generate(PROMPT, num_inference_steps=steps, seed=seed, **args)[0]
        self.images[name] = np.asarray(image.convert("RGB"))
        run = self.pipe.last_run
        return {
            "seconds_per_image": run.timings["total"],
            "ms_per_step": run.ms_per_step,
            "timings": dict(run.timings),
        }

    def compare(self, a: str, b: str) -> dict:
        x, y = self.images[a], self.images[b]
        return {
            "identical": bool(np.array_equal(x, y)),
            "max_abs_diff": int(abs_diff(x, y).max()),
            "psnr_db": psnr(x, y),
        }

    def save(self) -> None:
        if self.rank == 0:
            path = Path(self.args.out) / "parallel_bench.json"
            path.write_text(json.dumps(self.results, indent=2, default=float))

    @contextmanager
    def phase(self, name: str, leader_only: bool = False, timeout: float | None = None) -> Iterator[bool]:
        """Run a phase on every rank (or rank 0 while the others wait), save, and end the run if it hangs."""
        print(f"[rank {self.rank}] {name} ...", file=sys.stderr, flush=True)
        timer = threading.Timer(timeout or self.args.phase_timeout, self._hung, (name,))
        timer.start()
        start = time.perf_counter()
        try:
            yield not leader_only or self.rank == 0
        finally:
            timer.cancel()
        if leader_only:
            dist.barrier(group=self.waiting)
        print(f"[rank {self.rank}] {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        self.save()

    def _hung(self, name: str) -> None:
        self.results.setdefault("hung", []).append(name)
        self.save()
        print(f"[rank {self.rank}] {name} ran past its time limit: ending the run", flush=True)
        os._exit(4)


def run(bench: Bench) -> None:
    args, pipe, results = bench.args, bench.pipe, bench.results
    one, cfg2, uly = {}, {}, {}
    results |= {"one_gpu": one, "cfg2": cfg2, "ulysses2": uly}

    with bench.phase("1 GPU: true CFG image, CFG-off steps", leader_only=True) as mine:
        if mine:
            one["cfg"] = bench.generate("one-cfg", args.steps, cfg=True)
            one["cfg_off"] = bench.generate("one-nocfg", args.step_runs, cfg=False)

    with bench.phase("CFG-2: true CFG image"):
        pipe.set_parallel(ParallelPlan(cfg=2))
        cfg2["cfg"] = bench.generate("cfg2-cfg", args.steps, cfg=True)
        if bench.rank == 0:
            cfg2["vs_one_gpu"] = bench.compare("cfg2-cfg", "one-cfg")
            cfg2["speedup"] = one["cfg"]["seconds_per_image"] / cfg2["cfg"]["seconds_per_image"]

    with bench.phase("Ulysses-2: CFG-off steps (graph segments), true CFG image"):
        pipe.set_parallel(ParallelPlan(ulysses=2))
        uly["cfg_off"] = bench.generate("u2-nocfg", args.step_runs, cfg=False)
        uly["cfg"] = bench.generate("u2-cfg", args.steps, cfg=True)
        if bench.rank == 0:
            uly["step_speedup"] = one["cfg_off"]["ms_per_step"] / uly["cfg_off"]["ms_per_step"]
            uly["vs_one_gpu"] = bench.compare("u2-cfg", "one-cfg")
            uly["cfg_off_vs_one_gpu"] = bench.compare("u2-nocfg", "one-nocfg")

    with bench.phase("Ulysses-2: fp8-unfused vs fp8-fused"):
        if pipe.transformer.is_fp8:
            pipe.set_variant("fp8-unfused")
            uly["unfused_cfg_off"] = bench.generate("u2-nocfg-unfused", args.step_runs, cfg=False)
            pipe.set_variant("fp8-fused")
            uly["fused_vs_unfused"] = bench.compare("u2-nocfg", "u2-nocfg-unfused")

    graphs = pipe.cuda_graphs  # False on the CPU
    with bench.phase("Ulysses-2: eager steps"):
        pipe.cuda_graphs = False
        uly["eager_cfg_off"] = bench.generate("u2-nocfg-eager", args.step_runs, cfg=False)
        uly["eager_vs_graph"] = bench.compare("u2-nocfg-eager", "u2-nocfg")
        pipe.cuda_graphs = graphs

    # last, with a short limit: a replayed collective is not watched by NCCL, so a hang would not end
    with bench.phase("Ulysses-2: collectives captured in the graph", timeout=60):
        if graphs:
            pipe._graphed.cut_collectives = False
            pipe._graphed.graphs.clear()
            uly["captured_cfg_off"] = bench.generate("u2-nocfg-captured", args.step_runs, cfg=False)
            uly["captured_vs_segments"] = bench.compare("u2-nocfg-captured", "u2-nocfg")
    if torch.cuda.is_available():
        results["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    bench.save()


def table(results: dict) -> str:
    one, cfg2, uly = results["one_gpu"], results["cfg2"], results["ulysses2"]
    rows = [
        ("1 GPU, true CFG", f"{one['cfg']['seconds_per_image']:.2f} s/image", ""),
        (
            "CFG-2, true CFG",
            f"{cfg2['cfg']['seconds_per_image']:.2f} s/image",
            f"{cfg2['speedup']:.2f}x; PNG identical to 1 GPU: {cfg2['vs_one_gpu']['identical']}",
        ),
        (
            "Ulysses-2, true CFG",
            f"{uly['cfg']['seconds_per_image']:.2f} s/image",
            "vs 1 GPU: max abs diff {max_abs_diff}, PSNR {psnr_db:.1f} dB".format(**uly["vs_one_gpu"]),
        ),
        ("1 GPU, CFG off, batch 1", f"{one['cfg_off']['ms_per_step']:.1f} ms/step", ""),
        (
            "Ulysses-2, CFG off",
            f"{uly['cfg_off']['ms_per_step']:.1f} ms/step",
            f"{uly['step_speedup']:.2f}x" + (", graph segments" if "captured_cfg_off" in uly else ""),
        ),
    ]
    for key, label in (
        ("captured_cfg_off", "Ulysses-2, collectives captured"),
        ("eager_cfg_off", "Ulysses-2, eager"),
    ):
        if key in uly:
            rows.append((label, f"{uly[key]['ms_per_step']:.1f} ms/step", ""))
    lines = ["| run | time | notes |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint dir (bench/make_random_checkpoint.py); default: embedded")
    parser.add_argument("--device", default="cuda", help="cuda (NCCL), or cpu (gloo) for a smoke run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50, help="steps of the true-CFG images")
    parser.add_argument("--step-runs", type=int, default=20, help="steps of the CFG-off step-time runs")
    parser.add_argument("--phase-timeout", type=float, default=120)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    run(bench)
    if bench.rank == 0:
        print(table(bench.results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
