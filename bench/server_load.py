"""Load on the HTTP image server (ui/server.py): throughput and latency by concurrent clients, batching on vs
off in the same run, HTTP overhead against calling `generate()` directly, and whether batch rows equal
the same requests run alone on this device.

The model loads once. For each workload (size, steps or preset, the batch cap when batching is on):
- direct: `pipe.generate` on one request, timed (median of --direct-runs), and encoding its image in
  --output-format (png, jpeg or webp, at --output-compression) timed apart;
- identity: three requests denoised as one batch vs each alone, at the fixed batch size the server uses
  (must be equal) and at their own row counts (equal only where the kernels are batch-invariant);
- scaling: `Pipeline.run` on one request alone vs a full batch, timed directly (what batching can buy);
- served: for batching off (every request alone, as generate) and on (--max-batch rows per step, fixed
  batch shapes), the server in-process on 127.0.0.1 and C clients (each one keep-alive connection,
  sending its requests back to back) at each of --clients; images/s over the level's wall time and
  p50/p90/p99 latency. HTTP overhead = median latency at one client with batching off - direct generate(),
  for base64 responses and for URL responses (the image still encoded and cached, not downloaded); with
  --paired N also the median of N per-pair differences, each served request beside the same request called
  directly (drift between the phases cancels).
Prompts all have one token length (CUDA graphs are captured per length); every configuration is warmed
up first. Writes server_load.json under --out and prints a table.

    python -m bench.server_load --model /tmp/qwen-image-random-fp8 --out DIR        # one H200, ~5 min
    python -m bench.server_load --device cpu --dtype fp32 --workload cpu:128:8:4 --clients 1,4,16 --out DIR
    python -m bench.server_load ... --output-format jpeg --output-compression 90   # lossy responses
"""

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.in_thread import InThread
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.batching import BatchPlan
from qwen_image_fusion.ui.image_cache import Encoding, image_bytes
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.runner import Runner
from qwen_image_fusion.ui.server import build_server

TARGETS = {"http_overhead_ms": 20.0, "batching_speedup_16_clients_512": 1.3}  # issue 36


@dataclass(frozen=True)
class Workload:
    name: str
    size: int
    steps: int | None  # None: the preset's
    preset: str | None
    max_batch: int
    output_format: str = "png"  # the responses' (--output-format)
    output_compression: int = 100  # jpeg / webp only (--output-compression)

    @property
    def encoding(self) -> Encoding:
        return Encoding(self.output_format, self.output_compression)

    @classmethod
    def parse(cls, text: str) -> "Workload":
        """NAME:SIZE:STEPS_OR_PRESET:MAX_BATCH, e.g. 512:512:8:8 or 1024:1024:lightning-8:4."""
        name, size, steps, cap = text.split(":")
        preset = None if steps.isdigit() else steps
        return cls(name, int(size), None if preset else int(steps), preset, int(cap))

    def body(self, prompt: str, seed: int, response_format: str = "b64_json") -> dict[str, Any]:
        """The request (true CFG off: the preset's scale 1.0, or 1.0 given)."""
        body = {"prompt": prompt, "size": f"{self.size}x{self.size}", "seed": seed, "true_cfg_scale": 1.0}
        body["response_format"] = response_format
        body["output_format"] = self.output_format
        if self.output_format != "png":
            body["output_compression"] = self.output_compression
        return body | ({"preset": self.preset} if self.preset else {"num_inference_steps": self.steps})


def prompt_for(index: int) -> str:
    return f"server load request {index:04d}: a lighthouse on a cliff at dusk"


def percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {
        "p50": cuts[49],
        "p90": cuts[89],
        "p99": cuts[98],
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def generate_kwargs(work: Workload, index: int) -> dict[str, Any]:
    """`generate()`'s arguments for the request the server gets as `work.body(prompt_for(index), index)`."""
    kwargs = work.body(prompt_for(index), index)
    for key in ("size", "response_format", "output_format", "output_compression"):
        kwargs.pop(key, None)
    return kwargs | {"width": work.size, "height": work.size}


def direct(pipe: Any, work: Workload, runs: int) -> dict[str, float]:
    """Seconds of one `generate()` call (median) and of encoding its image as the server does."""
    kwargs = generate_kwargs(work, 0)
    pipe.generate(**kwargs)  # warm-up: graph capture at this shape
    times, encode = [], []
    for i in range(runs):
        start = _now(pipe)
        images = pipe.generate(**(kwargs | {"seed": i + 1}))
        times.append(_now(pipe) - start)
        start = time.perf_counter()
        image_bytes(images[0], work.encoding)
        encode.append(time.perf_counter() - start)
    return {"generate_s": statistics.median(times), "encode_s": statistics.median(encode)}


def paired_overhead(pipe: Any, work: Workload, pairs: int) -> dict[str, float]:
    """HTTP overhead by pairs: request i served (one client, batching off) right beside `generate()` of the
    same request called directly, in alternating order, so the GPU's drift between phases cancels; the
    median and spread of the per-pair differences (served - direct) in ms."""
    runner = Runner(pipe, Limits.for_device(pipe.device.type, max_work=1e9, time_limit_s=3600), None, 0.0)
    server = InThread(build_server(pipe, runner))
    differences = []
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:

            def served_s(index: int) -> float:
                start = time.perf_counter()
                response = http.post("/v1/images/generations", json=work.body(prompt_for(index), index))
                if response.status_code != 200:
                    raise RuntimeError(f"request {index}: {response.status_code} {response.text[:300]}")
                return time.perf_counter() - start

            def direct_s(index: int) -> float:
                start = _now(pipe)
                pipe.generate(**generate_kwargs(work, index))
                return _now(pipe) - start

            served_s(0), direct_s(0)  # warm-up
            for i in range(1, pairs + 1):
                if i % 2:
                    direct, served = direct_s(i), served_s(i)
                else:
                    served, direct = served_s(i), direct_s(i)
                differences.append(1000 * (served - direct))
    finally:
        server.close()
        runner.close()
    cuts = statistics.quantiles(differences, n=10, method="inclusive")
    return {"pairs": pairs, "median_ms": statistics.median(differences), "p10_ms": cuts[0], "p90_ms": cuts[8]}


def request_for(pipe: Any, work: Workload, index: int) -> Any:
    """The pipeline's request for `work`'s body with prompt and seed `index`."""
    return pipe.request(
        prompt_for(index),
        width=work.size,
        height=work.size,
        num_inference_steps=work.steps,
        preset=work.preset,
        true_cfg_scale=1.0,
        seed=index,
    )


def identity(pipe: Any, work: Workload) -> dict[str, Any]:
    """Three requests as one batch vs each alone: at the server's fixed size, and at their own row counts."""
    requests = [request_for(pipe, work, i) for i in range(3)]
    slots = max(3, BatchPlan(work.max_batch).slots(requests[0]))

    def first_images(results: list) -> list[bytes]:
        return [result.images[0].tobytes() for result in results]

    together = first_images(pipe.run(requests, slots))
    fixed = [first_images(pipe.run([r], slots))[0] for r in requests]
    own_rows = first_images(pipe.run(requests, 3))
    alone = [first_images(pipe.run([r]))[0] for r in requests]
    return {
        "fixed_batch_identical": together == fixed,
        "own_row_counts_identical": own_rows == alone,
        "fixed_slots": slots,
    }


def scaling(pipe: Any, work: Workload, rounds: int = 3) -> dict[str, float]:
    """One request alone vs a full batch of --max-batch requests, `Pipeline.run` timed directly (no HTTP;
    each request's text encoding included), alternated so clock drift hits both alike: what batching can
    buy, and what a lone request pays."""
    planned = pipe.memory is not None
    slots = BatchPlan.for_device(pipe.device, work.max_batch, planned).slots(request_for(pipe, work, 0))
    requests = [request_for(pipe, work, i) for i in range(slots)]
    pipe.run(requests[:1])  # warm-up: graph capture at both shapes
    pipe.run(requests, slots)
    alone, full = [], []
    for _ in range(rounds):
        start = _now(pipe)
        pipe.run(requests[:1])
        alone.append(_now(pipe) - start)
        start = _now(pipe)
        pipe.run(requests, slots)
        full.append(_now(pipe) - start)
    one, batch = statistics.median(alone), statistics.median(full)
    return {
        "slots": slots,
        "alone_s": one,
        "batch_s": batch,
        "throughput_gain": slots * one / batch,
        "lone_request_cost": batch / one,
    }


def served(
    pipe: Any,
    work: Workload,
    batching: bool,
    levels: list[int],
    requests: dict[int, int],
    window_s: float,
    response_format: str = "b64_json",
) -> dict:
    plan = BatchPlan.for_device(pipe.device, work.max_batch, pipe.memory is not None) if batching else None
    limits = Limits.for_device(pipe.device.type, queue_size=1024, max_work=1e9, time_limit_s=3600)
    runner = Runner(pipe, limits, plan, window_s)
    server = InThread(build_server(pipe, runner))
    if pipe.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(pipe.device)
    try:
        warm = plan.slots(request_for(pipe, work, 0)) if plan else 1
        _fire(server.url, work, warm, 1, first=9000)  # capture the batch shape's graphs
        results = {}
        for clients in levels:
            before = (runner.counters.batches, runner.counters.batch_requests)
            latencies, wall = _fire(
                server.url, work, clients, requests[clients], clients * 1000, response_format
            )
            batches = runner.counters.batches - before[0]
            results[str(clients)] = {
                "requests": len(latencies),
                "images_per_s": len(latencies) / wall,
                "wall_s": wall,
                "latency_s": percentiles(latencies),
                "mean_requests_per_batch": (runner.counters.batch_requests - before[1]) / batches
                if batches
                else 1.0,
            }
            row = results[str(clients)]
            print(
                f"  {work.name} batching {'on ' if batching else 'off'} {clients:>3} clients: "
                f"{row['images_per_s']:.2f} images/s, p50 {row['latency_s']['p50']:.3f} s",
                flush=True,
            )
    finally:
        server.close()
        runner.close()
    peak = torch.cuda.max_memory_allocated(pipe.device) if pipe.device.type == "cuda" else None
    return {"max_batch": work.max_batch if batching else 1, "peak_memory_bytes": peak, "by_clients": results}


def _fire(
    url: str, work: Workload, clients: int, each: int, first: int, response_format: str = "b64_json"
) -> tuple[list[float], float]:
    """`clients` clients, each sending `each` requests back to back; returns latencies and wall seconds."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            for r in range(each):
                index = first + c * each + r
                start = time.perf_counter()
                body = work.body(prompt_for(index), index, response_format)
                response = http.post("/v1/images/generations", json=body)
                elapsed = time.perf_counter() - start
                if response.status_code != 200:
                    raise RuntimeError(f"request {index}: {response.status_code} {response.text[:300]}")
                with lock:
                    latencies.append(elapsed)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return latencies, time.perf_counter() - start


def _now(pipe: Any) -> float:
    if pipe.device.type == "cuda":
        torch.cuda.synchronize(pipe.device)
    return time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint dir (default: the embedded model)")
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--variant", default="auto")
    parser.add_argument(
        "--workload",
        action="append",
        type=Workload.parse,
        help="NAME:SIZE:STEPS_OR_PRESET:MAX_BATCH (default: 1024:1024:lightning-8:4 and 512:512:8:8)",
    )
    parser.add_argument("--clients", default="1,4,16,40", help="comma-separated concurrency levels")
    parser.add_argument(
        "--requests",
        default="5,12,32,40",
        help="requests per level (rounded up to a multiple of the clients)",
    )
    parser.add_argument("--window-ms", type=float, default=20.0, help="the batching window")
    parser.add_argument("--direct-runs", type=int, default=5)
    parser.add_argument(
        "--paired", type=int, default=0, help="also the HTTP overhead from this many served/direct pairs"
    )
    parser.add_argument("--output-format", default="png", choices=("png", "jpeg", "webp"))
    parser.add_argument(
        "--output-compression",
        type=int,
        default=100,
        help="jpeg / webp quality, 0-100 (OpenAI's default 100)",
    )
    parser.add_argument("--threads", type=int, help="torch intra-op threads (CPU runs: 1 keeps them steady)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    workloads = args.workload or [Workload.parse("1024:1024:lightning-8:4"), Workload.parse("512:512:8:8")]
    formats = {"output_format": args.output_format, "output_compression": args.output_compression}
    workloads = [replace(work, **formats) for work in workloads]
    levels = [int(c) for c in args.clients.split(",")]
    totals = [int(r) for r in args.requests.split(",")]
    per_client = {c: -(-totals[min(i, len(totals) - 1)] // c) for i, c in enumerate(levels)}

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.time()
    pipe = load_pipeline(args.model, variant=args.variant, device=args.device, dtype=args.dtype)
    report: dict[str, Any] = {
        "model": pipe.model_name,
        "device": str(pipe.device),
        "variant": pipe.variant,
        "output_format": args.output_format,
        "output_compression": None if args.output_format == "png" else args.output_compression,
        "load_s": time.time() - start,
        "targets": TARGETS,
        "workloads": {},
    }
    if pipe.device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(pipe.device)
    for work in workloads:
        print(f"{work.name}: direct generate() and identity ...", flush=True)
        entry: dict[str, Any] = {"workload": work.__dict__, "direct": direct(pipe, work, args.direct_runs)}
        entry["identity"] = identity(pipe, work)
        entry["scaling"] = scaling(pipe, work)
        for batching in (False, True):
            entry["batching_on" if batching else "batching_off"] = served(
                pipe, work, batching, levels, per_client, args.window_ms / 1000
            )
        one = entry["batching_off"]["by_clients"].get("1")
        if one is not None:
            overhead = one["latency_s"]["p50"] - entry["direct"]["generate_s"]  # median against median
            entry["http_overhead_ms"] = 1000 * overhead
            entry["http_overhead_without_encoding_ms"] = 1000 * (overhead - entry["direct"]["encode_s"])
            url = served(pipe, work, False, [1], {1: per_client[1]}, 0.0, "url")["by_clients"]["1"]
            entry["http_overhead_url_ms"] = 1000 * (url["latency_s"]["p50"] - entry["direct"]["generate_s"])
        if args.paired:
            entry["http_overhead_paired"] = paired_overhead(pipe, work, args.paired)
            print(f"  {work.name} paired HTTP overhead: {entry['http_overhead_paired']}", flush=True)
        on, off = entry["batching_on"]["by_clients"], entry["batching_off"]["by_clients"]
        entry["speedup_by_clients"] = {c: on[c]["images_per_s"] / off[c]["images_per_s"] for c in off}
        report["workloads"][work.name] = entry
    report["total_s"] = time.time() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_load.json").write_text(json.dumps(report, indent=2))
    print(table(report))


def table(report: dict[str, Any]) -> str:
    """The load table (Markdown) for BENCHMARKS.md."""
    lines = [
        f"{report['model']} on {report.get('gpu', report['device'])}, variant {report['variant']}, "
        f"responses in {report.get('output_format', 'png')}"
        + (f" at compression {report['output_compression']}" if report.get("output_compression") else ""),
        "",
        "| workload | clients | batching | images/s | p50 s | p90 s | p99 s | requests/batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in report["workloads"].items():
        for key in ("batching_off", "batching_on"):
            mode = f"on ({entry[key]['max_batch']})" if key == "batching_on" else "off"
            for clients, row in entry[key]["by_clients"].items():
                lat = row["latency_s"]
                lines.append(
                    f"| {name} | {clients} | {mode} | {row['images_per_s']:.2f} | {lat['p50']:.3f} | "
                    f"{lat['p90']:.3f} | {lat['p99']:.3f} | {row['mean_requests_per_batch']:.1f} |"
                )
    lines.append("")
    for name, entry in report["workloads"].items():
        direct = entry["direct"]
        speedups = ", ".join(f"{c}: {s:.2f}x" for c, s in entry["speedup_by_clients"].items())
        lines.append(
            f"{name}: generate() {direct['generate_s']:.3f} s, encoding {1000 * direct['encode_s']:.1f} ms, "
            f"HTTP overhead {entry.get('http_overhead_ms', float('nan')):.1f} ms "
            f"({entry.get('http_overhead_without_encoding_ms', float('nan')):.1f} ms without encoding; "
            f"{entry.get('http_overhead_url_ms', float('nan')):.1f} ms for a URL response); batching "
            f"speed-up by clients {speedups}; run alone vs full batch {entry['scaling']}; identity "
            f"{entry['identity']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
