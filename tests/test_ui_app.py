"""UI logic and the /generate API against a fake pipeline: request checks, limits, the runner's per-job
stop flags, queueing, Stop, cancel, disconnect and sign-in.

The fake keeps these tests fast and lets them control timing; test_ui_served.py and test_ui_load.py use
the real pipeline.
"""

import json
import math
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr
import httpx
import pytest
from gradio import route_utils
from gradio_client import Client
from gradio_client.exceptions import AppError, AuthenticationError, ValidationError
from gradio_client.utils import Status
from helpers import wait_for
from PIL import Image

from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import CheckpointSpec, GenerationDefaults
from qwen_image_fusion.pipelines import RunInfo
from qwen_image_fusion.pipelines.generation_request import GenerationRequest, resolve_request
from qwen_image_fusion.pipelines.options import MAX_IMAGES_PER_REQUEST
from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.generation import (
    ASPECT_RATIOS,
    CUSTOM,
    FieldError,
    check_work,
    format_details,
    job_from_inputs,
    preset_for,
)
from qwen_image_fusion.ui.limits import DEVICE_LIMITS, Limits, work_of
from qwen_image_fusion.ui.runner import STOP_PRESSED, Job, Runner, Stopped

VARIANTS = ["reference", "contract", "fp8-unfused", "fp8-fused"]


class FakePipe:
    """docs/API.md's pipeline surface; each step sleeps `delay` s and records how many ran at once. Requests
    are resolved by the real `resolve_request`; each run's request lands in `calls` as a dict."""

    model_name = "fake"
    device = "cpu"
    size_multiple = 16
    defaults = GenerationDefaults(width=64, height=32, num_inference_steps=3, true_cfg_scale=4.0)
    spec = CheckpointSpec(
        family=SimpleNamespace(name="fake"), directory=Path("fake"), name="fake", attention_heads=24,
        size_multiple=16, defaults=defaults, weights=WeightFormat.BF16,
    )  # fmt: skip

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.variant = "fp8-fused"
        self.last_run: Any = None
        self.calls: list[dict[str, Any]] = []
        self.scales_set: list[dict[str, float]] = []
        self.steps_run = 0
        self.running = 0
        self.max_running = 0

    def available_variants(self) -> list[str]:
        return VARIANTS

    def set_variant(self, variant: str) -> None:
        self.variant = variant

    def set_lora_scales(self, scales: dict[str, float]) -> None:
        self.scales_set.append(dict(scales))

    def parallel_summary(self) -> str:
        return "CFG-2 x Ulysses-1 on 2 ranks (this is rank 0)"

    def request(self, prompt: str, **values: Any) -> GenerationRequest:
        return resolve_request(self.spec, prompt, **values)

    def run(self, requests: list[Any], slots: int | None = None, on_step: Any = None) -> list[Any]:
        return [self._run(r, on_step) for r in requests]

    def _run(self, r: GenerationRequest, on_step: Any) -> Any:
        if r.lora_scales:
            self.set_lora_scales(dict(r.lora_scales))
        negative = None if r.negative_prompts is None else r.negative_prompts[0]
        call = {"prompt": r.prompts[0], "negative_prompt": negative, "true_cfg_scale": r.true_cfg_scale}
        self.calls.append(call | {"seed": r.seed, "preset": r.preset, "lora_scales": dict(r.lora_scales)})
        if not r.prompts[0].strip():
            raise InputError("prompt is empty: describe the image to generate")
        w, h, n = r.width, r.height, r.num_inference_steps
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            for i in range(1, n + 1):
                time.sleep(self.delay)
                self.steps_run += 1
                on_step(i, n)
        finally:
            self.running -= 1
        timings = {"text_encoding": 0.1, "denoising": 0.2, "decoding": 0.3, "total": 0.6}
        fusion = "FP8 norm+quant fusion: 240/240 block paths"
        self.last_run = RunInfo(r.seed, w, h, n, self.variant, fusion, timings)
        # Distinct per seed: Gradio rewrites byte-identical outputs in place, racing concurrent downloads.
        color = (200, r.seed % 256, len(self.calls) % 256)
        return SimpleNamespace(
            images=[Image.new("RGB", (w, h), color)] * r.num_images_per_prompt, info=self.last_run
        )


def _job_of(values: dict[str, Any], session: str = "s") -> Job:
    return job_from_inputs(session, values, FakePipe())


def _inputs(**changes: Any) -> dict[str, Any]:
    """A valid /generate request as raw JSON values, with `changes`."""
    values = {
        "prompt": "a red apple",
        "negative_prompt": "",
        "aspect": CUSTOM,
        "width": 64,
        "height": 32,
        "num_inference_steps": 3,
        "true_cfg_scale": 4.0,
        "seed": 7,
        "randomize_seed": False,
        "num_images": 1,
        "variant": "contract",
    }
    return values | changes


def test_presets() -> None:
    assert preset_for(928, 1664) == "9:16"
    assert preset_for(256, 256) == CUSTOM
    assert len(ASPECT_RATIOS) == 7 and all(w % 16 == 0 and h % 16 == 0 for w, h in ASPECT_RATIOS.values())


def test_job_from_inputs_reads_a_valid_request() -> None:
    job = _job_of(_inputs(width=96.0, negative_prompt="blurry"))
    assert (job.session, job.variant) == ("s", "contract")
    assert job.request == GenerationRequest(
        prompts=("a red apple",), negative_prompts=("blurry",), width=96, height=32, num_inference_steps=3,
        true_cfg_scale=4.0, seed=7, num_images_per_prompt=1,
    )  # fmt: skip
    assert type(job.request.width) is int
    preset = _job_of(_inputs(aspect="16:9", width=None, negative_prompt=""))
    r = preset.request
    assert (r.width, r.height, r.negative_prompts) == (1664, 928, None)
    seeds = {_job_of(_inputs(randomize_seed=True)).request.seed for _ in range(5)}
    assert len(seeds) > 1 and all(
        0 <= s < 2**31 for s in seeds
    )  # picked per request, so a stop can report it
    assert _job_of(_inputs(seed=None)).request.seed is not None


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"num_inference_steps": math.nan}, "num_inference_steps", "must be a finite number, not nan"),
        ({"num_images": math.inf}, "num_images", "must be a finite number, not inf"),
        ({"true_cfg_scale": -math.inf}, "true_cfg_scale", "must be a finite number"),
        ({"width": "abc"}, "width", "width must be a number, not 'abc'"),
        ({"num_inference_steps": "50"}, "num_inference_steps", "must be a number, not '50'"),
        ({"seed": True}, "seed", "must be a number, not True"),
        ({"height": None}, "height", "must be a number, not None"),
        ({"num_images": 2.5}, "num_images", "2.5 must be a whole number"),
        (
            {"num_images": MAX_IMAGES_PER_REQUEST + 1},
            "num_images",
            f"must be between 1 and {MAX_IMAGES_PER_REQUEST}",
        ),
        ({"randomize_seed": "yes"}, "randomize_seed", "must be true or false"),
        ({"prompt": ["a", "b"]}, "prompt", "prompt must be text, not list"),
        ({"prompt": "   "}, "prompt", "prompt is empty"),
        ({"prompt": "x" * 20_001}, "prompt", "at most 20000"),
        ({"aspect": "5:4"}, "aspect", "must be one of 1:1, 16:9"),
        ({"variant": "fp4"}, "variant", "'fp4' is not served here"),
        ({"width": 50}, "width", "width 50 must be a multiple of 16"),
        ({"height": 4096}, "height", "between 16 and 2048"),
        ({"num_inference_steps": 1}, "num_inference_steps", "must be between 2 and 200"),
        ({"seed": -2}, "seed", "seed -2 must be an integer"),
        ({"true_cfg_scale": -2}, "true_cfg_scale", "must be a finite number >= 0"),
    ],
)
def test_job_from_inputs_names_the_bad_value(changes: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(FieldError, match=re.escape(message)) as err:
        _job_of(_inputs(**changes))
    assert err.value.field == field
    assert isinstance(err.value, InputError)  # the CLI and the page show it as one line


def test_limits_defaults_overrides_and_checks() -> None:
    cuda, cpu = Limits.for_device("cuda"), Limits.for_device("cpu", queue_size=3, max_work=None)
    assert (cuda.max_work, cuda.time_limit_s) == DEVICE_LIMITS["cuda"]
    assert (cpu.max_work, cpu.time_limit_s, cpu.queue_size, cpu.jobs_per_client) == (
        *DEVICE_LIMITS["cpu"],
        3,
        1,
    )
    assert Limits.for_device("mps") == Limits.for_device("cpu")
    assert all(f"{value:g}" in cpu.describe() for value in (*DEVICE_LIMITS["cpu"], 3))
    for bad in ({"max_work": math.nan}, {"time_limit_s": 0}, {"queue_size": 0}, {"jobs_per_client": 1.5}):
        with pytest.raises(InputError, match=next(iter(bad))):
            Limits.for_device("cpu", **bad)


def test_cost_cap_counts_pixels_steps_images_and_cfg() -> None:
    assert work_of(1000, 1000, 10, 2, true_cfg=True) == 40.0
    limits = Limits(max_work=40.0, time_limit_s=10)
    request = _inputs(width=1008, height=992, num_inference_steps=10, num_images=4)
    at_cap = _job_of(request)
    assert not at_cap.request.true_cfg and at_cap.work == pytest.approx(39.99744)  # 1008x992 is 0.999936 MP
    check_work(at_cap, limits)
    over = _job_of(request | {"negative_prompt": "blurry"})
    assert over.request.true_cfg and over.work == pytest.approx(2 * at_cap.work)
    with pytest.raises(
        FieldError,
        match=r"79\.99 megapixel-steps \(width 1008 × height 992 / 10⁶ × num_inference_steps 10 × "
        r"num_images 4 × 2 for true CFG \(negative_prompt with true_cfg_scale > 1\)\); "
        r".*at most 40 per request",
    ) as refused:
        check_work(over, limits)
    assert refused.value.field == "num_inference_steps"
    no_cfg = _job_of(request | {"negative_prompt": "blurry", "true_cfg_scale": 1.0})
    check_work(no_cfg, limits)  # a negative prompt at scale 1 runs no CFG, so it costs no more


def _job(session: str, steps: int) -> Job:
    return _job_of(_inputs(num_inference_steps=steps), session)


def test_runner_switches_variant_and_counts_steps() -> None:
    pipe = FakePipe()
    runner = Runner(pipe, Limits(max_work=100, time_limit_s=60))
    seen: list[tuple[int, int]] = []
    job = _job("a", 2)
    images, run = runner.run(job, lambda i, n: seen.append((i, n)))
    assert pipe.variant == run.variant == "contract" and len(images) == 1
    assert seen == [(1, 2), (2, 2)] and job.steps_done == 2 and job.done and not job.stopped
    assert runner.jobs() == []


def test_stop_flags_belong_to_jobs() -> None:
    """A session's second job does not take over the first one's flag: Stop reaches both, and stopping
    one job leaves the other running."""
    pipe = FakePipe(delay=0.01)
    runner = Runner(pipe, Limits(max_work=100, time_limit_s=60))
    first, second, other = _job("a", 200), _job("a", 3), _job("b", 3)
    results: dict[str, Any] = {}

    def run(name: str, job: Job) -> None:
        try:
            results[name] = runner.run(job, lambda i, n: None)
        except Stopped as stopped:
            results[name] = stopped

    threads = [threading.Thread(target=run, args=item) for item in [("first", first)]]
    threads[0].start()
    wait_for(lambda: first.steps_done > 0)
    for name, job in [("second", second), ("other", other)]:
        threads.append(threading.Thread(target=run, args=(name, job)))
        threads[-1].start()
    wait_for(lambda: len(runner.jobs()) == 3)  # two wait for the device behind the first
    assert runner.stop_session("a", STOP_PRESSED) == [first, second]
    for thread in threads:
        thread.join(10)
    assert isinstance(results["first"], Stopped) and results["first"].by_user
    assert str(results["first"]) == f"Stopped after {first.steps_done} of 200 steps."
    assert first.steps_done < 200
    assert isinstance(results["second"], Stopped) and second.steps_done == 0  # stopped before it started
    assert len(results["other"][0]) == 1  # session b's job ran to the end
    assert pipe.max_running == 1 and runner.jobs() == []


def test_time_limit_stops_a_running_job() -> None:
    pipe = FakePipe(delay=0.02)
    job = _job("a", 200)
    with pytest.raises(
        Stopped, match=r"^Stopped after \d+ of 200 steps: this server stops a request after 0.1 s\.$"
    ):
        Runner(pipe, Limits(max_work=100, time_limit_s=0.1)).run(job, lambda i, n: None)
    assert 1 <= job.steps_done < 50


def test_details_show_seed_stages_and_fusion() -> None:
    pipe = FakePipe()
    pipe.run([_job("a", 3).request], on_step=lambda i, n: None)
    text = format_details(pipe.last_run)
    for part in ("`7`", "64×32", "66.7 ms/step", "FP8 fused", "240/240", "text encoding", "decoding"):
        assert part in text


LIMITS = Limits(max_work=1.0, time_limit_s=60, queue_size=8)


def test_page_header_names_the_model_device_and_parallel_plan() -> None:
    demo = build_app(FakePipe(), LIMITS)
    texts = [block.value for block in demo.blocks.values() if type(block).__name__ == "Markdown"]
    header = next(t for t in texts if t.startswith("# Qwen-Image"))
    assert "Model `fake` on `cpu`, CFG-2 x Ulysses-1 on 2 ranks (this is rank 0)." in header
    assert LIMITS.describe() in header


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakePipe, Runner, str]]:
    pipe = FakePipe(delay=0.05)
    runner = Runner(pipe, LIMITS)
    demo = build_app(pipe, LIMITS, runner)
    _, url, _ = demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        yield pipe, runner, url
    finally:
        demo.close()


def _client(url: str, **kwargs: Any) -> Client:
    return Client(url, verbose=False, analytics_enabled=False, **kwargs)


def _wait_idle(pipe: FakePipe, runner: Runner, within: float) -> float:
    """Seconds until nothing runs or waits in the runner; fails after `within`."""
    return wait_for(lambda: not runner.jobs() and not pipe.running, within)


def test_api_generate_then_error_then_generate(served: tuple[FakePipe, Runner, str]) -> None:
    pipe, _, url = served
    client = _client(url)
    images, seed, details = client.predict(
        "a red apple", "blurry", "custom", 48, 32, 2, 3.5, 7, False, 2, "contract", api_name="/generate"
    )
    assert len(images) == 2 and Image.open(images[0]["image"]).size == (48, 32)
    assert seed == 7 and "`7`" in details
    call = pipe.calls[-1]
    assert (call["negative_prompt"], call["true_cfg_scale"], pipe.variant) == ("blurry", 3.5, "contract")

    with pytest.raises(ValidationError, match="multiple of 16"):
        client.predict("x", aspect=CUSTOM, width=50, api_name="/generate")
    with pytest.raises(ValidationError, match="prompt is empty"):
        client.predict("  ", api_name="/generate")

    calls = len(pipe.calls)
    _, seed, details = client.predict("again", aspect=CUSTOM, num_inference_steps=2, api_name="/generate")
    assert seed == pipe.calls[-1]["seed"] and f"`{seed}`" in details  # random by default (seed -1)
    assert "was not used" not in details  # no seed given: nothing ignored
    assert len(pipe.calls) == calls + 1  # the refused requests never reached the pipeline
    _, seed, details = client.predict(
        "given", aspect=CUSTOM, num_inference_steps=2, seed=5, api_name="/generate"
    )
    assert seed == pipe.calls[-1]["seed"] == 5 and "was not used" not in details  # a given seed is used
    _, seed, details = client.predict(
        "both", aspect=CUSTOM, num_inference_steps=2, seed=5, randomize_seed=True, api_name="/generate"
    )
    assert seed == pipe.calls[-1]["seed"]
    assert details.startswith("**Note:** seed 5 was not used: randomize_seed is on")


def test_bad_values_are_refused_with_a_message_and_no_traceback(
    served: tuple[FakePipe, Runner, str], capfd: pytest.CaptureFixture[str]
) -> None:
    """NaN, infinity and strings in number fields, as raw JSON (gradio_client cannot send NaN)."""
    pipe, _, url = served
    calls = len(pipe.calls)
    row = ["x", "", "custom", 64, 32, 2, 4, 0, False, 1, "contract"]
    for index, raw, message in [
        (5, "NaN", "num_inference_steps must be a finite number, not nan"),
        (9, "Infinity", "num_images must be a finite number, not inf"),
        (3, "1e999", "width must be a finite number, not inf"),
        (6, '"4"', "true_cfg_scale must be a number, not '4'"),
        (7, "-Infinity", "seed must be a finite number, not -inf"),
    ]:
        data = ", ".join(raw if i == index else json.dumps(v) for i, v in enumerate(row))
        response = httpx.post(
            f"{url}gradio_api/call/generate",
            content=f'{{"data": [{data}]}}',
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 422
        refused = [d for d in response.json()["detail"] if not d["is_valid"]]
        assert [(d["parameter_name"], d["message"]) for d in refused] == [(message.split()[0], message)]
    assert len(pipe.calls) == calls
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def test_cost_cap_refuses_before_queueing(served: tuple[FakePipe, Runner, str]) -> None:
    pipe, _, url = served
    calls = len(pipe.calls)
    with pytest.raises(
        ValidationError,
        match=r"3\.527 megapixel-steps \(width 1328 × height 1328 / 10⁶ × num_inference_steps 2 × "
        r"num_images 1\); .* at most 1 ",
    ):
        _client(url).predict("big", aspect="1:1", num_inference_steps=2, api_name="/generate")
    assert len(pipe.calls) == calls


def test_queue_runs_one_at_a_time_and_reports_positions(served: tuple[FakePipe, Runner, str]) -> None:
    pipe, _, url = served
    clients = [_client(url) for _ in range(3)]  # one request per client at a time
    jobs = [
        client.submit(f"p{i}", num_inference_steps=30, api_name="/generate")
        for i, client in enumerate(clients)
    ]
    ranks = {0}
    while not all(job.done() for job in jobs):
        ranks |= {s.rank for s in (job.status() for job in jobs) if s.code is Status.IN_QUEUE and s.rank}
        time.sleep(0.01)
    assert all(len(job.result(timeout=30)[0]) == 1 for job in jobs)
    assert pipe.max_running == 1
    assert max(ranks) >= 1  # a job waited behind another and was told its position


def test_one_request_per_client_at_a_time(served: tuple[FakePipe, Runner, str]) -> None:
    _, runner, url = served
    client, other = _client(url), _client(url)
    first = client.submit("first", num_inference_steps=40, api_name="/generate")
    wait_for(lambda: runner.jobs())
    with pytest.raises(ValidationError, match="already have 1 request waiting or running"):
        client.predict("second", num_inference_steps=2, api_name="/generate")
    assert len(other.predict("another client", num_inference_steps=2, api_name="/generate")[0]) == 1
    assert len(first.result(timeout=30)[0]) == 1
    assert len(client.predict("after the first", num_inference_steps=2, api_name="/generate")[0]) == 1


def test_stop_ends_the_running_generation_with_its_step_count(served: tuple[FakePipe, Runner, str]) -> None:
    pipe, runner, url = served
    client = _client(url)
    job = client.submit("long", num_inference_steps=200, seed=11, randomize_seed=False, api_name="/generate")
    wait_for(lambda: runner.jobs() and runner.jobs()[0].steps_done > 2)
    message = client.predict(api_name="/stop")
    k = int(message.split()[2])
    assert message == f"Stopped after {k} of 200 steps." and 2 < k < 100
    assert job.result(timeout=10) == ([], 11, message)  # no images; the seed and the details say what ran
    assert _wait_idle(pipe, runner, within=1.0) < 1.0


def test_stop_is_answered_at_once_while_a_long_step_runs() -> None:
    """A step longer than gradio_client's 5 s read timeout: /stop answers at once with the steps done, the
    request returns then, and the device drops the job when its step ends (no further step runs)."""
    pipe = FakePipe(delay=6.0)
    runner = Runner(pipe, LIMITS)
    demo = build_app(pipe, LIMITS, runner)
    _, url, _ = demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        client = _client(url)
        job = client.submit(
            "long", num_inference_steps=3, seed=11, randomize_seed=False, api_name="/generate"
        )
        wait_for(lambda: pipe.running)
        start = time.monotonic()
        message = client.predict(api_name="/stop")
        assert message == "Stopped after 0 of 3 steps." and time.monotonic() - start < 2.0
        assert job.result(timeout=2) == ([], 11, message)
        assert pipe.steps_run == 0 and pipe.running  # answered while the step still runs
        assert _wait_idle(pipe, runner, within=8.0) < 8.0
        assert pipe.steps_run == 1
    finally:
        demo.close()


def test_cancel_frees_the_server_within_a_step(served: tuple[FakePipe, Runner, str]) -> None:
    pipe, runner, url = served
    client = _client(url)
    job = client.submit("abandoned", num_inference_steps=200, api_name="/generate")
    # Running, as the client knows it: gradio_client needs the event id it stores after joining to cancel.
    wait_for(lambda: job.status().code in (Status.PROCESSING, Status.PROGRESS))
    before = pipe.steps_run
    job.cancel()
    assert _wait_idle(pipe, runner, within=2.0) < 2.0
    assert pipe.steps_run - before < 20
    waited = _client(url).submit("next", num_inference_steps=2, api_name="/generate")
    assert len(waited.result(timeout=10)[0]) == 1


def test_disconnect_frees_the_server(served: tuple[FakePipe, Runner, str]) -> None:
    """A client process killed while its request runs (it has seen progress): its heartbeat connection
    drops, and Gradio's unload event stops its job."""
    pipe, runner, url = served
    script = (
        "import sys, time\nfrom gradio_client import Client\nfrom gradio_client.utils import Status\n"
        "c = Client(sys.argv[1], verbose=False, analytics_enabled=False)\n"
        "job = c.submit('gone', num_inference_steps=200, api_name='/generate')\n"
        "while job.status().code is not Status.PROGRESS:\n    time.sleep(0.01)\n"
        "print('running', flush=True)\ntime.sleep(120)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, url], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "running\n"
        assert pipe.running
    finally:
        child.kill()
        child.wait()
    assert _wait_idle(pipe, runner, within=2.0) < 2.0


def test_time_limit_through_the_api() -> None:
    pipe = FakePipe(delay=0.05)
    demo = build_app(pipe, Limits(max_work=100, time_limit_s=0.2))
    _, url, _ = demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        with pytest.raises(
            AppError, match=r"Stopped after \d of 200 steps: this server stops a request after 0.2 s"
        ):
            _client(url).predict("slow", num_inference_steps=200, api_name="/generate")
    finally:
        demo.close()


def test_sign_in_is_required_when_accounts_are_given() -> None:
    pipe = FakePipe()
    demo = build_app(pipe, LIMITS)
    _, url, _ = demo.launch(
        server_name="127.0.0.1",
        prevent_thread_lock=True,
        quiet=True,
        auth=[("alice", "s3cret"), ("bob", "pw")],
    )
    try:
        assert httpx.get(f"{url}config").status_code == 401
        with pytest.raises(AuthenticationError, match="credentials were not provided"):
            _client(url)
        for wrong in (("alice", "wrong"), ("mallory", "s3cret")):
            with pytest.raises(ValueError, match="Could not login"):
                _client(url, auth=wrong)
        images, _, _ = _client(url, auth=("bob", "pw")).predict(
            "x", num_inference_steps=2, api_name="/generate"
        )
        assert len(images) == 1
    finally:
        demo.close()


def _sweep_while_a_request_lands(demo: Any, files: set[str], tmp_path: Any, monkeypatch: Any) -> None:
    """Gradio's cache sweep over `demo`, with a request adding a file to `files` as the sweep reads the
    first file's age (the race of a worker-thread sweep and a request thread, made deterministic)."""
    old = tmp_path / "old.png"
    old.write_bytes(b"png")
    files.add(str(old))
    real_path = route_utils.Path

    class LandingPath(type(real_path())):
        def lstat(self) -> Any:
            files.add(str(tmp_path / f"new{len(files)}.png"))
            return super().lstat()

    monkeypatch.setattr(route_utils, "Path", LandingPath)
    route_utils.delete_files_created_by_app(demo, age=None)
    assert not old.exists()


def test_the_cache_sweep_survives_a_request_landing_mid_sweep(tmp_path: Any, monkeypatch: Any) -> None:
    """A plain set (what Gradio gives) breaks Gradio's sweep, which then never runs again; the app's sets
    do not: the old file is deleted and the one that landed is kept for the next sweep."""
    with pytest.raises(RuntimeError, match="Set changed size during iteration"):
        plain = SimpleNamespace(blocks={}, temp_file_sets=[set()])
        _sweep_while_a_request_lands(plain, plain.temp_file_sets[0], tmp_path, monkeypatch)
    demo = build_app(FakePipe(), Limits.for_device("cpu"))
    gallery = next(block for block in demo.blocks.values() if isinstance(block, gr.Gallery))
    assert gallery.temp_files in demo.temp_file_sets and demo.upload_file_set in demo.temp_file_sets
    _sweep_while_a_request_lands(demo, gallery.temp_files, tmp_path, monkeypatch)
    assert len(gallery.temp_files) == 1
