"""`qwen-image serve` as a user runs it: --help, the loopback rule with API keys, key files, a taken port
and bad limits refused before anything loads, and the real command serving the API and the page."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import REPO

import ui.server
from ui.cli import main
from ui.limits import Limits

KEY = "serve-test-key-0123456789"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replaces ui.server.serve (model load + server) with a recorder; the CLI's checks run for real."""
    calls: list[dict[str, Any]] = []

    def fake_serve(model: Any, host: str, port: int, **kwargs: Any) -> None:
        calls.append({"host": host, "port": port, **kwargs})
        kwargs["on_start"](port, Limits.for_device("cpu", **kwargs["limits"]), "off (each request alone)")

    monkeypatch.setattr(ui.server, "serve", fake_serve)
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


@pytest.mark.slow
def test_the_real_command_serves_the_api_and_the_page(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY + "\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["serve", "--port", str(port), "--api-key-file", str(keys), "--ui", "--dtype", "fp32"]
    env = os.environ | {"GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "ui.cli", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines: list[str] = []
        while not lines or not lines[-1].startswith("Limits:"):
            line = server.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert f"Qwen-Image API on http://127.0.0.1:{port}/v1 (Ctrl+C stops it)." in "".join(lines)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        image = client.images.generate(
            prompt="a red circle", size="32x32", extra_body={"num_inference_steps": 2}
        )
        assert len(image.data[0].b64_json) > 100
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/ui/config").status_code == 401  # the page's sign-in takes an API key
        login = httpx.post(f"{url}/ui/login", data={"username": "anyone", "password": KEY})
        assert login.status_code == 200
    finally:
        server.send_signal(signal.SIGINT)
        try:
            exit_code = server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            exit_code = "none: still serving 20 s after Ctrl+C"
    assert exit_code == 130, exit_code


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
        ui.server.run_until_stopped(server)
    assert server.stopped == signal.SIGINT
    ui.server.run_until_stopped(_StoppedServer(signal.SIGTERM))
