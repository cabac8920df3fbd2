"""The served app (embedded model) under load and over a soak, through bench/ui_load.py's client code.

fp32 and one torch thread keep a 64x64 x 2-step request near 0.1 s on 2 busy CPU cores (bf16's text
encoding alone takes 0.2 s, and a second intra-op thread fights Gradio and the clients for the cores).
"""

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gradio_client import Client
from helpers import rss_bytes

from bench.ui_load import ServedApp, add_server_times, fire, prompt_for, start_app, summarize
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.limits import Limits

QUEUE = 16
CLIENTS = 40
KEEP_S = 3  # images older than this are deleted, checked every second (Limits.keep_images_minutes)
REQUEST = {"aspect": "custom", "width": 64, "height": 64, "num_inference_steps": 2, "negative_prompt": ""}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedApp, Path]]:
    """The served app and the directory of its Gradio cache."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("gradio-cache")
    env = pytest.MonkeyPatch()
    env.setenv("GRADIO_TEMP_DIR", str(cache))  # read as the app's blocks are made
    limits = Limits.for_device("cpu", queue_size=QUEUE, keep_images_minutes=KEEP_S / 60)
    served = start_app(load_pipeline(dtype="fp32"), limits)
    try:
        yield served, cache
    finally:
        served.close()
        env.undo()
        torch.set_num_threads(threads)


def test_forty_clients_complete_in_order_or_get_queue_full(app: tuple[ServedApp, Path]) -> None:
    """The generation is held until all 40 have submitted: one runs, QUEUE wait, the rest are refused
    with "queue full"; none hangs, and the accepted ones run in the order they arrived."""
    served, _ = app
    release = threading.Event()
    run = served.pipe.run

    def held(*args: Any, **kwargs: Any) -> Any:
        release.wait(60)
        return run(*args, **kwargs)

    served.pipe.run = held  # type: ignore[method-assign]
    try:
        records = fire(served.url, CLIENTS, REQUEST, timeout_s=120, after_submit=release.set)
    finally:
        served.pipe.run = run  # type: ignore[method-assign]
    add_server_times(records, served.timeline)
    summary = summarize(records, served.timeline)
    assert summary["outcomes"] == {"ok": QUEUE + 1, "queue full": CLIENTS - QUEUE - 1}
    assert [r.index for r in records if r.outcome == "ok"] == list(range(QUEUE + 1))
    assert summary["order_kept"]
    assert all(r.queue_wait_s >= 0 and r.run_s > 0 for r in records if r.outcome == "ok")


@pytest.mark.slow
def test_soak_keeps_memory_and_cache_flat(app: tuple[ServedApp, Path]) -> None:
    """200 sequential requests (random seeds, so every PNG is new): the process's RSS grows by less than
    50 MB and Gradio's sweep, asked to run every second, keeps deleting cached images older than KEEP_S to
    the end (a sweep that dies on a request landing mid-sweep, as Gradio's did, leaves them all)."""
    served, cache = app
    assert served.demo.delete_cache == (1, KEEP_S)  # (every, older than) seconds
    client = Client(served.url, verbose=False, analytics_enabled=False)
    request = REQUEST | {"randomize_seed": True}
    for i in range(10):  # warm-up: allocator pools, Gradio's first-call caches
        client.predict(prompt_for(i), **request, api_name="/generate")
    gc.collect()
    rss_before = rss_bytes()
    oldest_s, counts = 0.0, []
    for i in range(200):
        client.predict(prompt_for(i), **request, api_name="/generate")
        if i % 20 == 19:
            ages = _file_ages(cache)
            counts.append(len(ages))
            oldest_s = max([oldest_s, *ages])
    gc.collect()
    growth_mb = (rss_bytes() - rss_before) / 2**20
    print(f"soak: RSS growth {growth_mb:.1f} MB, files per 20 requests {counts}, oldest {oldest_s:.1f} s")
    assert growth_mb < 50
    assert oldest_s < KEEP_S + 1 + 3  # deleted after KEEP_S, checked every second; 3 s for a loaded CPU
    assert max(counts) < 100  # 200 images were made


def _file_ages(folder: Path) -> list[float]:
    """Seconds since each file under `folder` was written (Gradio may delete one while we look)."""
    now, ages = time.time(), []
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                ages.append(now - path.stat().st_mtime)
        except FileNotFoundError:
            continue
    return ages
