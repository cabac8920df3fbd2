"""/metrics of the HTTP server: the runner's queue, jobs, batches and stage seconds, the HTTP requests, the
URL image cache and GPU memory, in Prometheus' text format."""

import threading
from typing import Any

from qwen_image_fusion.ui.image_cache import ImageCache
from qwen_image_fusion.ui.runner import Runner


class HttpCounters:
    """Requests answered, by route and status, and the seconds they took, for /metrics."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.counts[route, status] = self.counts.get((route, status), 0) + 1
            self.seconds[route] = self.seconds.get(route, 0.0) + seconds


def prometheus_text(runner: Runner, cache: ImageCache, http: HttpCounters, device: Any) -> str:
    """/metrics in Prometheus' text format: queue, jobs, batches, stage seconds, HTTP, cache, GPU memory."""
    c = runner.counters
    queued = runner.queue_depth()
    images, cached = cache.usage()
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP qwen_image_{name} {help}", f"# TYPE qwen_image_{name} {kind}"])
        lines.extend(f"qwen_image_{name}{labels} {value:g}" for labels, value in samples)

    metric("queue_depth", "gauge", "Requests waiting for the device.", [("", queued)])
    metric("running_jobs", "gauge", "Requests on the device now.", [("", len(runner.jobs()) - queued)])
    metric("queue_size", "gauge", "Requests that may wait (more get 429).", [("", runner.limits.queue_size)])
    with c.lock:
        jobs = sorted(c.jobs.items())
        stages = [(stage, c.stage_seconds[stage], c.stage_count[stage]) for stage in c.stage_seconds]
        batches = [("", c.batches)], [("", c.batch_requests)], [("", c.batch_slots)]
    metric(
        "jobs_total",
        "counter",
        "Requests by outcome (ok, stopped, failed, queue_full).",
        [(f'{{outcome="{o}"}}', n) for o, n in jobs],
    )
    lines.extend(
        [
            "# HELP qwen_image_stage_seconds Seconds spent per pipeline stage.",
            "# TYPE qwen_image_stage_seconds summary",
        ]
    )
    for stage, seconds, count in stages:
        lines.append(f'qwen_image_stage_seconds_sum{{stage="{stage}"}} {seconds:g}')
        lines.append(f'qwen_image_stage_seconds_count{{stage="{stage}"}} {count}')
    metric("batches_total", "counter", "Batches run (requests sharing denoising steps).", batches[0])
    metric("batch_requests_total", "counter", "Requests the batches held.", batches[1])
    metric("batch_slots_total", "counter", "Slots the batches ran (requests plus padding).", batches[2])
    with http._lock:
        counts, seconds = sorted(http.counts.items()), sorted(http.seconds.items())
    metric(
        "http_requests_total",
        "counter",
        "HTTP requests answered, by route and status.",
        [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in counts],
    )
    metric(
        "http_seconds_total",
        "counter",
        "Seconds spent answering HTTP requests, by route.",
        [(f'{{route="{r}"}}', s) for r, s in seconds],
    )
    metric("image_cache_images", "gauge", "Images kept for URL responses.", [("", images)])
    metric("image_cache_bytes", "gauge", "Bytes of images kept for URL responses.", [("", cached)])
    metric(
        "gpu_memory_bytes", "gauge", "CUDA memory of the serving device (none on a CPU).", _gpu_memory(device)
    )
    return "\n".join(lines) + "\n"


def _gpu_memory(device: Any) -> list[tuple[str, float]]:
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return []
    _, total = torch.cuda.mem_get_info(device)
    kinds = {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
        "total": total,
    }
    return [(f'{{kind="{kind}"}}', value) for kind, value in kinds.items()]
