"""UI logic and the /generate API against a fake pipeline: sizes, details, errors, queueing, Stop.

The fake keeps these tests fast and lets them control timing; test_ui_browser.py uses the real pipeline.
"""

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from gradio_client.utils import Status
from PIL import Image

from models.errors import InputError
from ui.app import build_app
from ui.generation import CUSTOM, PRESETS, Cancelled, Runner, format_details, preset_for, resolve_size


class FakePipe:
    """docs/API.md's pipeline surface; each step sleeps `delay` s and records how many ran at once."""

    model_name = "fake"
    device = "cpu"
    defaults = SimpleNamespace(width=64, height=32, num_inference_steps=3, true_cfg_scale=4.0)

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.variant = "fp8-fused"
        self.last_run: Any = None
        self.calls: list[dict[str, Any]] = []
        self.steps_run = 0
        self.running = 0
        self.max_running = 0

    def available_variants(self) -> list[str]:
        return ["reference", "contract", "fp8-unfused", "fp8-fused"]

    def set_variant(self, variant: str) -> None:
        self.variant = variant

    def generate(self, prompt: str, on_step: Any = None, **kw: Any) -> list[Image.Image]:
        self.calls.append(kw | {"prompt": prompt})
        if not prompt.strip():
            raise InputError("prompt is empty: describe the image to generate")
        w, h, n = kw["width"], kw["height"], kw["num_inference_steps"]
        if w % 16 or h % 16:
            raise InputError(f"width {w} must be a multiple of 16 between 16 and 2048")
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            for i in range(1, n + 1):
                time.sleep(self.delay)
                self.steps_run += 1
                on_step(i, n)
        finally:
            self.running -= 1
        seed = 1234 if kw["seed"] is None else kw["seed"]
        timings = {"text_encoding": 0.1, "denoising": 0.2, "decoding": 0.3, "total": 0.6}
        self.last_run = SimpleNamespace(
            seed=seed, width=w, height=h, num_inference_steps=n, variant=self.variant,
            fusion_summary="FP8 norm+quant fusion: 240/240 block paths", timings=timings, ms_per_step=66.7,
        )  # fmt: skip
        return [Image.new("RGB", (w, h), (200, 30, 30))] * kw["num_images_per_prompt"]


def test_sizes() -> None:
    assert resolve_size("16:9", 64, 64) == (1664, 928)
    assert resolve_size(CUSTOM, 96.0, 48) == (96, 48)
    assert resolve_size(CUSTOM, None, 48) == (None, 48)
    assert preset_for(928, 1664) == "9:16"
    assert preset_for(256, 256) == CUSTOM
    assert len(PRESETS) == 7 and all(w % 16 == 0 and h % 16 == 0 for w, h in PRESETS.values())


def test_runner_switches_variant_and_stops_only_its_session() -> None:
    pipe = FakePipe()
    runner = Runner(pipe)
    seen: list[tuple[int, int]] = []
    images, run = runner.run("a", "contract", lambda i, n: seen.append((i, n)), **_args(steps=2))
    assert pipe.variant == run.variant == "contract" and len(images) == 1
    assert seen == [(1, 2), (2, 2)]

    def stop_from_step(i: int, n: int) -> None:
        assert not runner.stop("other session")
        assert runner.stop("a")

    with pytest.raises(Cancelled):
        runner.run("a", "contract", stop_from_step, **_args(steps=5))
    assert pipe.steps_run == 2 + 2  # stopped right after the step that pressed Stop
    assert not runner.stop("a")  # nothing running any more


def test_details_show_seed_stages_and_fusion() -> None:
    pipe = FakePipe()
    pipe.generate(on_step=lambda i, n: None, **_args(seed=42))
    text = format_details(pipe.last_run)
    for part in ("`42`", "64×32", "66.7 ms/step", "FP8 fused", "240/240", "text encoding", "decoding"):
        assert part in text


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakePipe, Client]]:
    pipe = FakePipe(delay=0.05)
    demo = build_app(pipe)
    _, url, _ = demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        yield pipe, Client(url, verbose=False, analytics_enabled=False)
    finally:
        demo.close()


def test_api_generate_then_error_then_generate(served: tuple[FakePipe, Client]) -> None:
    pipe, client = served
    images, seed, details = client.predict(
        "a red apple", "blurry", "custom", 48, 32, 2, 3.5, 7, False, 2, "contract", api_name="/generate"
    )
    assert len(images) == 2 and Image.open(images[0]["image"]).size == (48, 32)
    assert seed == 7 and "`7`" in details
    call = pipe.calls[-1]
    assert (call["negative_prompt"], call["true_cfg_scale"], pipe.variant) == ("blurry", 3.5, "contract")

    with pytest.raises(AppError, match="multiple of 16"):
        client.predict("x", aspect=CUSTOM, width=50, api_name="/generate")
    with pytest.raises(AppError, match="prompt is empty"):
        client.predict("  ", api_name="/generate")

    _, seed, _ = client.predict("again", aspect="1:1", num_inference_steps=2, api_name="/generate")
    assert seed == 1234  # randomized by default: the pipeline picks (here: the fake's fixed) seed
    assert (pipe.calls[-1]["width"], pipe.calls[-1]["height"], pipe.calls[-1]["seed"]) == (1328, 1328, None)


def test_queue_runs_one_at_a_time_and_reports_positions(served: tuple[FakePipe, Client]) -> None:
    pipe, client = served
    jobs = [client.submit(f"p{i}", num_inference_steps=10, api_name="/generate") for i in range(3)]
    ranks = {0}
    while not all(job.done() for job in jobs):
        ranks |= {s.rank for s in (job.status() for job in jobs) if s.code is Status.IN_QUEUE and s.rank}
        time.sleep(0.01)
    assert all(len(job.result(timeout=30)[0]) == 1 for job in jobs)
    assert pipe.max_running == 1
    assert max(ranks) >= 1  # a job waited behind another and was told its position


def test_stop_aborts_the_running_generation(served: tuple[FakePipe, Client]) -> None:
    pipe, client = served
    before = pipe.steps_run
    job = client.submit("long", num_inference_steps=200, api_name="/generate")
    _wait_for(lambda: pipe.steps_run > before)
    client.predict(api_name="/stop")
    with pytest.raises(AppError, match="Stopped"):
        job.result(timeout=10)
    assert pipe.steps_run - before < 100
    assert len(client.predict("after stop", num_inference_steps=2, api_name="/generate")[0]) == 1


def _args(steps: int = 3, seed: int | None = None) -> dict[str, Any]:
    size = {"width": 64, "height": 32}
    return size | {"prompt": "p", "num_inference_steps": steps, "seed": seed, "num_images_per_prompt": 1}


def _wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
