"""`qwen-image ui` as a user runs it: --help states the limits, a non-loopback address needs sign-in
(or an explicit --no-auth, with a warning), accounts from flags and files, and the real server behind
--auth with Gradio's share link kept off whatever the environment says.
"""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AuthenticationError

from qwen_image_fusion.ui import app
from qwen_image_fusion.ui.access import is_loopback
from qwen_image_fusion.ui.cli import main
from qwen_image_fusion.ui.limits import DEVICE_LIMITS, Limits


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replaces qwen_image_fusion.ui.app.launch (model load + server) with a recorder; the CLI's policy runs
    for real."""
    calls: list[dict[str, Any]] = []

    def fake_launch(
        model: Any, *, host: str, port: int, limits: dict, auth: Any, on_start: Any, **_: Any
    ) -> None:
        calls.append({"host": host, "port": port, "limits": limits, "auth": auth})
        on_start(port, Limits.for_device("cpu", **limits))

    monkeypatch.setattr(app, "launch", fake_launch)
    return calls


def test_help_states_the_limits_and_their_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_code:
        main(["ui", "--help"])
    assert exit_code.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    (cuda_work, cuda_s), (cpu_work, cpu_s) = DEVICE_LIMITS["cuda"], DEVICE_LIMITS["cpu"]
    for part in (
        "--max-work MP_STEPS",
        f"(default: {cuda_work:g} on CUDA, {cpu_work:g} on CPU)",
        f"(default: {cuda_s:g} on CUDA, {cpu_s:g} on CPU)",
        '"queue full" (default: 64)',
        "waiting or running (default: 1)",
        "this long (default: 30)",
        "--auth USER:PASS",
        "(default: 127.0.0.1)",
        "--auth-file FILE",
        "--no-auth",
        "qwen-image ui --host 0.0.0.0 --auth alice:s3cret",
    ):
        assert part in text, part


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_non_loopback_address_without_accounts_is_refused_in_one_line(
    host: str, served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ui", "--host", host]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: --host {host} serves the demo beyond this machine: add --auth USER:PASS")
    assert served == []  # refused before loading anything


def test_no_auth_serves_openly_with_a_warning(
    served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ui", "--host", "0.0.0.0", "--no-auth", "--port", "7999"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith(
        "warning: serving on 0.0.0.0:7999 without sign-in (--no-auth): anyone who can reach"
    )
    assert served == [{"host": "0.0.0.0", "port": 7999, "limits": served[0]["limits"], "auth": None}]
    assert "Qwen-Image demo on http://0.0.0.0:7999" in out
    assert main(["ui", "--no-auth"]) == 0  # on loopback there is nothing to warn about
    assert "warning" not in capsys.readouterr().err


def test_accounts_from_flags_and_file(
    served: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    accounts = tmp_path / "accounts.txt"
    accounts.write_text("# team\ncarol:pa:ss\n\n  dave:x  \n")
    argv = [
        "ui",
        "--host",
        "0.0.0.0",
        "--auth",
        "alice:s3cret",
        "--auth",
        "bob:pw",
        "--auth-file",
        str(accounts),
    ]
    assert main(argv) == 0
    assert served[0]["auth"] == [("alice", "s3cret"), ("bob", "pw"), ("carol", "pa:ss"), ("dave", "x")]
    out, err = capsys.readouterr()
    assert "Sign-in required: 4 accounts." in out and "warning" not in err


def test_local_serving_tells_how_to_serve_others(
    served: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            ["ui", "--max-work", "12.5", "--time-limit", "30", "--queue-size", "5", "--jobs-per-client", "2"]
        )
        == 0
    )
    assert served[0]["limits"] == {
        "max_work": 12.5,
        "time_limit_s": 30.0,
        "queue_size": 5,
        "jobs_per_client": 2,
        "keep_images_minutes": None,
    }
    out = capsys.readouterr().out
    assert "To serve others: qwen-image ui --host 0.0.0.0 --auth USER:PASS" in out
    assert "Limits: 12.5 megapixel-steps and 30 s per request, 5 waiting, 2 per client." in out
    assert "share" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-auth", "--auth", "a:b"], "error: --no-auth contradicts --auth/--auth-file"),
        (["--auth-file", "/nonexistent/accounts"], "error: cannot read auth file /nonexistent/accounts"),
        (["--auth-file", "{bad}"], "line 2: expected USER:PASS"),
        (["--auth-file", "{empty}"], "has no USER:PASS line"),
        (["--auth", "alice"], "argument --auth: expected USER:PASS, got 'alice'"),
        (["--auth", ":pw"], "expected USER:PASS"),
        (["--max-work", "0"], "argument --max-work: expected a number above 0, got '0'"),
        (["--time-limit", "nan"], "expected a number above 0, got 'nan'"),
        (["--queue-size", "2.5"], "argument --queue-size: expected a number, got '2.5'"),
    ],
)
def test_bad_ui_arguments_are_refused(
    argv: list[str],
    message: str,
    served: list[dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "bad").write_text("alice:ok\nno colon here\n")
    (tmp_path / "empty").write_text("# nobody yet\n")
    argv = [arg.format(bad=tmp_path / "bad", empty=tmp_path / "empty") for arg in argv]
    try:
        assert main(["ui", *argv]) == 2
    except SystemExit as exit_code:  # argparse's own errors
        assert exit_code.code == 2
    assert message in capsys.readouterr().err
    assert served == []


def test_is_loopback() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.0.2.7", "no-such-host.invalid"):
        assert not is_loopback(host), host


@pytest.mark.slow
def test_served_with_auth_and_share_off(tmp_path: Path) -> None:
    """The real command on all interfaces with an account and GRADIO_SHARE=True in the environment."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = os.environ | {"GRADIO_SHARE": "True", "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    argv = ["ui", "--host", "0.0.0.0", "--port", str(port), "--auth", "alice:s3cret", "--dtype", "fp32"]
    server = subprocess.Popen(
        [sys.executable, "-m", "qwen_image_fusion.ui.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        while not lines or not lines[-1].startswith("Limits:"):
            line = server.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        output = "".join(lines)
        assert f"Qwen-Image demo on http://0.0.0.0:{port}" in output
        assert "Sign-in required: 1 account." in output
        assert not re.search(r"share|public|gradio\.live", output, re.IGNORECASE), output
        url = f"http://127.0.0.1:{port}/"
        with pytest.raises(AuthenticationError):
            Client(url, verbose=False, analytics_enabled=False)
        client = Client(url, auth=("alice", "s3cret"), verbose=False, analytics_enabled=False)
        images, _, _ = client.predict("a fox", aspect="custom", width=64, height=64, api_name="/generate")
        assert len(images) == 1
        upload = httpx.post(
            f"{url}gradio_api/upload", files={"files": ("a.png", b"\0" * 2048)}, cookies=client.cookies
        )
        assert upload.status_code == 413  # the page takes no files
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
