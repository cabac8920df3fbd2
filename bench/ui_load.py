"""Load run against the served web demo: N gradio_client clients, one request each, latency percentiles.

Starts the app in-process on 127.0.0.1 (the model loaded once, the given limits), makes one warm-up
request, then N clients submit one request each back to back (each as soon as the previous one is in
the queue, so arrival order is submission order) and wait together. Per request it records the outcome
("ok", "queue full", or the error), the queue wait (submit to the start of its generation, read on the
server), the run time (its generation) and the latency the client saw (submit to result). Writes
ui_load.json under --out: every request, and p50/p90/p99/max of latency, queue wait and run time.

    python bench/ui_load.py --out /tmp/ui-load                                   # embedded model, CPU
    python bench/ui_load.py --model CKPT --clients 40 --size 1024 --steps 20 --out DIR   # on a GPU
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr
from gradio_client import Client
from gradio_client.exceptions import AppError, ValidationError
from gradio_client.utils import QueueError, Status

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.generation import Pipeline
from qwen_image_fusion.ui.limits import Limits

SUBMITTED = (Status.STARTING, Status.JOINING_QUEUE)  # still on the way to the server's queue


@dataclass
class ServedApp:
    """The running demo, its pipeline, and when each prompt's generation started and ended (server side)."""

    demo: gr.Blocks
    pipe: Pipeline
    url: str
    timeline: dict[str, tuple[float, float]] = field(default_factory=dict)  # prompt -> (start, end)

    def close(self) -> None:
        self.demo.close()


@dataclass
class RequestRecord:
    index: int
    outcome: str  # "ok", "queue full", "hung", or the error message
    submitted: float  # time.monotonic() when it went in
    finished: float | None = None  # time.monotonic() when the client had its result (or refusal)
    queue_wait_s: float | None = None  # submit to the start of its generation
    run_s: float | None = None  # its generation on the server
    latency_s: float | None = None  # submit to the result, as the client saw it


def start_app(pipe: Pipeline, limits: Limits) -> ServedApp:
    """Serve `pipe` on 127.0.0.1, recording each generation's start and end by prompt."""
    run = pipe.run
    app = ServedApp(demo=build_app(pipe, limits), pipe=pipe, url="")

    def timed_run(requests: list[Any], *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return run(requests, *args, **kwargs)
        finally:
            for request in requests:
                app.timeline[request.prompts[0]] = (start, time.monotonic())

    pipe.run = timed_run  # type: ignore[method-assign]
    _, app.url, _ = app.demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    return app


def prompt_for(index: int) -> str:
    """One prompt per request, all of the same token length (CUDA graphs are captured per length)."""
    return f"load test request {index:04d}: a lighthouse on a cliff at dusk"


def fire(
    url: str,
    clients: int,
    request: dict[str, Any],
    timeout_s: float,
    after_submit: Callable[[], None] | None = None,
    first_index: int = 0,
) -> list[RequestRecord]:
    """`clients` clients submit one /generate request each, in index order, then wait together."""
    with ThreadPoolExecutor(8) as pool:
        connected = list(
            pool.map(lambda _: Client(url, verbose=False, analytics_enabled=False), range(clients))
        )
    jobs, records = [], []
    for i, client in enumerate(connected, first_index):
        record = RequestRecord(i, "hung", time.monotonic())
        records.append(record)
        jobs.append(client.submit(prompt_for(i), **request, api_name="/generate"))
        jobs[-1].add_done_callback(lambda _, record=record: setattr(record, "finished", time.monotonic()))
        while jobs[-1].status().code in SUBMITTED:
            time.sleep(0.002)
    if after_submit is not None:
        after_submit()
    deadline = time.monotonic() + timeout_s
    for job, record in zip(jobs, records, strict=True):
        try:
            job.result(timeout=max(0.0, deadline - time.monotonic()))
            record.outcome = "ok"
            record.finished = record.finished or time.monotonic()  # its done callback may still be on its way
            record.latency_s = record.finished - record.submitted
        except TimeoutError:
            job.cancel()
        except QueueError:
            record.outcome = "queue full"
        except (AppError, ValidationError) as err:
            record.outcome = str(err)
    with ThreadPoolExecutor(8) as pool:  # each close waits up to 1 s for its heartbeat thread
        list(pool.map(Client.close, connected))
    return records


def _connect(url: str) -> Client:
    return Client(url, verbose=False, analytics_enabled=False)


def add_server_times(records: list[RequestRecord], timeline: dict[str, tuple[float, float]]) -> None:
    for record in records:
        if record.outcome == "ok":
            start, end = timeline[prompt_for(record.index)]
            record.queue_wait_s, record.run_s = start - record.submitted, end - start


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "max": max(values)}


def summarize(records: list[RequestRecord], timeline: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Counts by outcome, whether the server ran requests in arrival order, and the percentiles."""
    done = [r for r in records if r.outcome == "ok"]
    started = sorted(done, key=lambda r: timeline[prompt_for(r.index)][0])
    outcomes: dict[str, int] = {}
    for record in records:
        outcomes[record.outcome] = outcomes.get(record.outcome, 0) + 1
    return {
        "outcomes": outcomes,
        "order_kept": [r.index for r in started] == [r.index for r in done],
        "latency_s": percentiles([r.latency_s for r in done if r.latency_s is not None]),
        "queue_wait_s": percentiles([r.queue_wait_s for r in done if r.queue_wait_s is not None]),
        "run_s": percentiles([r.run_s for r in done if r.run_s is not None]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint dir (default: the embedded model)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", help="bf16 (default) or fp32")
    parser.add_argument("--variant", default="auto")
    parser.add_argument("--clients", type=int, default=40, help="concurrent clients, one request each")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--images", type=int, default=1, help="images per request")
    parser.add_argument("--negative-prompt", default="", help="true CFG when given")
    parser.add_argument("--max-work", type=float, help="megapixel-steps per request (default: the device's)")
    parser.add_argument("--time-limit", type=float, help="seconds per request (default: the device's)")
    parser.add_argument("--queue-size", type=int, help="requests that may wait (default: --clients)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for all requests")
    parser.add_argument("--out", required=True, help="directory for ui_load.json")
    args = parser.parse_args()

    pipe = load_pipeline(args.model, variant=args.variant, device=args.device, dtype=args.dtype)
    limits = Limits.for_device(
        pipe.device.type,
        max_work=args.max_work,
        time_limit_s=args.time_limit,
        queue_size=args.queue_size or args.clients,
    )
    request = {
        "negative_prompt": args.negative_prompt,
        "aspect": "custom",
        "width": args.size,
        "height": args.size,
        "num_inference_steps": args.steps,
        "num_images": args.images,
        "randomize_seed": False,
        "seed": 0,
    }
    app = start_app(pipe, limits)
    try:
        warmup = fire(app.url, 1, request, args.timeout, first_index=9999)[0]
        if warmup.outcome != "ok":
            raise SystemExit(f"warm-up request failed: {warmup.outcome}")
        records = fire(app.url, args.clients, request, args.timeout)
    finally:
        app.close()
    add_server_times(records, app.timeline)
    report = {
        "model": pipe.model_name,
        "device": str(pipe.device),
        "variant": pipe.variant,
        "request": request,
        "limits": asdict(limits),
        "clients": args.clients,
        "wall_s": max(r.finished or r.submitted for r in records) - records[0].submitted,
        "summary": summarize(records, app.timeline),
        "requests": [asdict(r) for r in records],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ui_load.json").write_text(json.dumps(report, indent=2))
    print(
        json.dumps(
            {k: report[k] for k in ("model", "device", "variant", "clients", "wall_s", "summary")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
