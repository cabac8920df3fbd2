"""`qwen-image serve` as a user runs it: --help, the loopback rule with API keys, key files, a taken port
and bad limits refused before anything loads, and the real command serving the API and the page."""

import base64
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import REPO

import qwen_image_fusion.ui.server as ui_server
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.pipelines.memory_plan import minimum_budget
from qwen_image_fusion.ui.cli import main
from qwen_image_fusion.ui.commands import serve_workload
from qwen_image_fusion.ui.limits import Limits

KEY = "serve-test-key-0123456789"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replaces qwen_image_fusion.ui.server.serve (model load + server) with a recorder; the CLI's checks run
    for real."""
    calls: list[dict[str, Any]] = []

    def fake_serve(model: Any, host: str, port: int, **kwargs: Any) -> None:
        calls.append({"host": host, "port": port, **kwargs})
        limits = Limits.for_device("cpu", **kwargs["limits"])
        kwargs["on_start"](port, limits, "off (each request alone)", "")

    monkeypatch.setattr(ui_server, "serve", fake_serve)
    return calls


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_help_names_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_code:
        main(["serve", "--help"])
    assert exit_code.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for part in (
        "--api-key-file FILE",
        "--no-auth",
        "--ui",
        "--max-batch IMAGES",
        "(default: 8000)",
        "--max-upload-mb MB",
        "--cache-mb MB",
        "qwen-image serve --host 0.0.0.0 --api-key-file keys.txt",
        "the HTTP API is bounded by --queue-size alone",
    ):
        assert part in text, part


def test_open_address_needs_keys(
    served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, _, err = _run(["serve", "--host", "0.0.0.0", "--port", "0"], capsys)
    assert status == 2 and served == []
    assert err == (
        "error: --host 0.0.0.0 serves the API beyond this machine: add --api-key-file FILE (one key per "
        "line), or --no-auth to let anyone who can reach it in\n"
    )
    status, out, err = _run(["serve", "--host", "0.0.0.0", "--port", "0", "--no-auth"], capsys)
    assert status == 0 and err.startswith("warning: serving on 0.0.0.0:0 without sign-in (--no-auth)")
    assert "Qwen-Image API on http://0.0.0.0:0/v1: every address of this machine" in out
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# ours\n{KEY}\n")
    status, out, _ = _run(["serve", "--host", "0.0.0.0", "--port", "0", "--api-key-file", str(keys)], capsys)
    assert status == 0 and served[-1]["keys"] == [KEY]
    assert "API keys required: 1 (Authorization: Bearer KEY)." in out


def test_local_serving_says_how_to_serve_others(
    served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--port", "0", "--ui", "--max-batch", "4", "--batch-window-ms", "5", "--queue-size", "3"]
    status, out, _ = _run(argv, capsys)
    assert status == 0
    call = served[-1]
    assert (call["ui"], call["max_batch"], call["window_s"], call["limits"]["queue_size"]) == (
        True,
        4,
        0.005,
        3,
    )
    assert "Web demo on http://127.0.0.1:0/ui/, on the same queue." in out
    assert "Only this machine can reach it. To serve others: qwen-image serve --host 0.0.0.0" in out


def test_bad_arguments_are_refused_before_loading(
    served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("tooshort\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, message in [
            (["--api-key-file", str(keys)], f"error: {keys} line 1: an API key is one word of at least 16"),
            (["--api-key-file", str(tmp_path / "none")], "error: cannot read API key file"),
            (["--port", str(port)], f"error: cannot listen on 127.0.0.1:{port}: "),
            (["--port", "0", "--model", str(tmp_path)], "error: "),
            (["--port", "0", "--lora-dir", str(tmp_path)], f"error: LoRA directory {tmp_path} holds no"),
        ]:
            status, _, err = _run(["serve", *argv], capsys)
            assert status == 2 and err.startswith(message) and len(err.splitlines()) == 1, err
    for argv in (["--max-batch", "0"], ["--max-upload-mb", "nan"], ["--batch-window-ms", "-1"]):
        with pytest.raises(SystemExit) as exit_code:
            main(["serve", *argv])
        assert exit_code.value.code == 2
    assert served == []


@contextmanager
def real_server(argv: list[str], ready: str = "Limits:") -> Iterator[tuple[str, list[str]]]:
    """`qwen-image serve --port P ARGV` in its own process until the block ends (then Ctrl+C, which must end
    it with 130); yields its URL and the lines it printed up to the one starting with `ready`."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = os.environ | {"GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "qwen_image_fusion.ui.cli", "serve", "--port", str(port), *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines: list[str] = []
        while not lines or not lines[-1].startswith(ready):
            line = server.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        yield f"http://127.0.0.1:{port}", lines
    finally:
        server.send_signal(signal.SIGINT)
        try:
            exit_code = server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            exit_code = "none: still serving 20 s after Ctrl+C"
    assert exit_code == 130, exit_code


@pytest.mark.slow
def test_the_real_command_serves_the_api_and_the_page(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY + "\n")
    argv = ["--api-key-file", str(keys), "--ui", "--dtype", "fp32"]
    with real_server(argv) as (url, lines):
        port = url.rsplit(":", 1)[1]
        assert f"Qwen-Image API on http://127.0.0.1:{port}/v1 (Ctrl+C stops it)." in "".join(lines)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        image = client.images.generate(
            prompt="a red circle", size="32x32", extra_body={"num_inference_steps": 2}
        )
        assert len(image.data[0].b64_json) > 100
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/ui/config").status_code == 401  # the page's sign-in takes an API key
        login = httpx.post(f"{url}/ui/login", data={"username": "anyone", "password": KEY})
        assert login.status_code == 200


def _served_pngs(url: str, seeds: list[int], together: bool) -> list[bytes]:
    """The PNG bytes of a 64x64 two-step request per seed (one prompt length), sent at once or one by one."""

    def ask(seed: int) -> bytes:
        body = {
            "prompt": f"a red circle, request {seed}",
            "size": "64x64",
            "seed": seed,
            "num_inference_steps": 2,
        }
        response = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return base64.b64decode(response.json()["data"][0]["b64_json"])

    if not together:
        return [ask(seed) for seed in seeds]
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(ask, seeds))


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(
        next(line.split()[-1] for line in text.splitlines() if line.startswith(f"qwen_image_{name} "))
    )


@pytest.mark.slow
def test_serve_under_a_memory_budget_batches_with_the_bytes_of_requests_alone() -> None:
    """`qwen-image serve --gpu-memory --max-batch 4` on the CPU (standing in for the GPU, as the streaming
    tests do), through the real command: the plan holds four rows of the largest preset with blocks
    streamed; four concurrent requests share denoising steps under it, and each response is the same bytes
    as that request served alone at the same budget and by a server with everything resident."""
    spec = inspect_checkpoint(None)
    workload = serve_workload(spec, 4)  # what `serve --max-batch 4` plans for
    need = minimum_budget(spec.family.memory_profile(spec, 4, 4), workload, graphs=False, fixed_reserve=0)
    budget = f"{math.ceil(need / 2**20) + 1}MiB"
    common = ["--device", "cpu", "--dtype", "fp32", "--max-batch", "4", "--batch-window-ms", "2000"]
    seeds = [11, 12, 13, 14]
    with real_server([*common, "--gpu-memory", budget], ready="Memory:") as (url, lines):
        assert "blocks streamed" in lines[-1], lines[-1]
        together = _served_pngs(url, seeds, together=True)
        assert _metric(url, "batches_total") < 4 and _metric(url, "batch_requests_total") == 4
        alone = _served_pngs(url, seeds, together=False)
    with real_server(common) as (url, lines):
        assert not any(line.startswith("Memory:") for line in lines)  # everything resident
        resident = _served_pngs(url, seeds, together=False)
    assert together == alone == resident
    assert len(set(together)) == 4


class _StoppedServer:
    """A server whose run() stops on `sig` (its handler called, as uvicorn's capture does) and returns."""

    def __init__(self, sig: int) -> None:
        self.sig = sig

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.stopped = sig

    def run(self) -> None:
        self.handle_exit(self.sig, None)


def test_ctrl_c_ends_serving_with_keyboard_interrupt_even_when_asyncio_swallows_it() -> None:
    """uvicorn's re-raised SIGINT can be lost in asyncio.run; `run_until_stopped` raises it (the command then
    exits 130); another signal stops it quietly."""
    server = _StoppedServer(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        ui_server.run_until_stopped(server)
    assert server.stopped == signal.SIGINT
    ui_server.run_until_stopped(_StoppedServer(signal.SIGTERM))
