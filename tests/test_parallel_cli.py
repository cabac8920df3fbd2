"""Several ranks from the command line and when one fails (gloo on the CPU, processes started by the tests):
`qwen-image generate` as two ranks writes the one-process PNG, a rank that dies ends the others with an
error line within the timeout, and the launcher stops the other ranks when one fails."""

import json
import subprocess
import sys
import time

import pytest
from helpers import RANK_SCRIPT, REPO, free_port, launch, rank_env

pytestmark = pytest.mark.slow


@pytest.mark.cpu_dtype
def test_cli_generate_as_two_ranks_writes_the_one_process_png(tmp_path):
    """Each rank runs one thread (as torch's launcher sets it), and so does the one process compared:
    CPU kernels may split their sums by thread count."""
    args = ["a red fox", "--negative-prompt", "blurry", "--width", "64", "--height", "48", "--steps", "2"]
    args += ["--seed", "5", "--device", "cpu"]
    command = [sys.executable, "-m", "qwen_image_fusion.ui.cli", "generate", *args]
    result = launch(2, [*command, "-o", str(tmp_path / "two.png")])
    assert result.returncode == 0, result.stderr[-4000:]
    alone = subprocess.run([*command, "-o", str(tmp_path / "one.png")], env=rank_env(), cwd=REPO, check=False)
    assert alone.returncode == 0
    assert (tmp_path / "two.png").read_bytes() == (tmp_path / "one.png").read_bytes()


def test_a_rank_that_dies_ends_the_others_with_an_error(tmp_path):
    """Plain processes, no launcher: the surviving rank's own collective fails, within the timeout."""
    timeout_s = 20
    env = rank_env(timeout_s) | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["WORLD_SIZE"] = "2"
    ranks = [
        subprocess.Popen(
            [sys.executable, RANK_SCRIPT, "die", str(tmp_path)],
            env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        start = time.monotonic()
        statuses = [proc.wait(timeout=120) for proc in ranks]
        elapsed = time.monotonic() - start
    finally:
        for proc in ranks:
            proc.kill()
    assert statuses == [1, 3]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["error"].startswith("rank 0: the CFG gather across 2 ranks failed")
    assert seen["seconds"] < timeout_s
    print(f"surviving rank: {seen['error']!r} after {seen['seconds']:.2f} s (run {elapsed:.1f} s)")


def test_the_launcher_stops_the_other_ranks_when_one_fails():
    stay = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(120)"
    start = time.monotonic()
    result = launch(2, [sys.executable, "-c", stay], timeout=100)
    assert result.returncode == 10
    assert "rank 1 exited with status 3" in result.stdout
    assert time.monotonic() - start < 60  # rank 0 was stopped, not waited for
