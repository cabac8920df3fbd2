"""The documented examples run as written: every fenced `bash` or `python` block that a doc marks with
`<!-- cpu-example -->` on the line before it runs on this CPU with the embedded default model;
`<!-- cpu-example: server -->` blocks run against `qwen-image ui` started as the doc says (on a free port
in place of 7860), `<!-- cpu-example: serve -->` blocks against `qwen-image serve` (in place of 8000).

Shell blocks run line by line (a trailing `\\` continues a line; `#` comments are dropped) in a temporary
folder, with `qwen-image` meaning this checkout's CLI (`python -m qwen_image_fusion.ui.cli`) and a leading
`pip install ... &&` dropped (CI has just run that install). Python blocks run as one script. Each must
exit 0. Examples that cannot run here (a real checkpoint, a GPU, a server left running) stay unmarked, and
the doc says why beside them.
"""

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pytest
from helpers import REPO, free_port

DOCS = (
    "README.md",
    "docs/API.md",
    "docs/caching.md",
    "docs/fp8.md",
    "docs/memory.md",
    "docs/nvfp4.md",
    "docs/server.md",
    "ui/README.md",
    "eval/README.md",
)
BLOCK = re.compile(r"^<!-- cpu-example(?:: (server|serve))? -->\n```(bash|python)\n(.*?)\n```", re.M | re.S)
# The server a marked block runs against: its command, the port the doc names, what it prints once up.
SERVERS = {"server": ("ui", "7860", "Qwen-Image demo on"), "serve": ("serve", "8000", "Qwen-Image API on")}

pytestmark = pytest.mark.slow


def examples() -> list[tuple[str, str, str, str]]:
    """(doc, the server it needs ('' for none), language, code) of every marked block."""
    return [
        (doc, server, language, code)
        for doc in DOCS
        for server, language, code in BLOCK.findall((REPO / doc).read_text(encoding="utf-8"))
    ]


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: continued lines joined, comments and the install prefix dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
        line = re.sub(r"^pip install [^&]*&&\s*", "", line)
        if line:
            commands.append(
                re.sub(r"(^|&&\s*)qwen-image ", rf"\1{sys.executable} -m qwen_image_fusion.ui.cli ", line)
            )
    return commands


def test_the_docs_mark_their_cpu_examples():
    found = examples()
    docs = {doc for doc, *_ in found}
    assert docs == set(DOCS), docs  # every doc shows at least one example that runs here


@contextmanager
def demo_server(env: dict[str, str], kind: str) -> Iterator[str]:
    """`qwen-image ui` (or `serve`) on a free port until the block is done; yields the port."""
    name, _, ready = SERVERS[kind]
    port = str(free_port())
    command = [sys.executable, "-m", "qwen_image_fusion.ui.cli", name, "--port", port]
    server = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        for line in server.stdout:
            if ready in line:
                break
        else:
            pytest.fail(f"qwen-image {name} exited before serving")
        yield port
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.cpu_dtype
@pytest.mark.parametrize(("doc", "server", "language", "code"), examples(), ids=lambda v: str(v)[:40])
def test_example_runs_as_written(doc, server, language, code, tmp_path):
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    with demo_server(env, server) if server else nullcontext() as port:
        if server:
            code = code.replace(SERVERS[server][1], port)
        if language == "python":
            runs = [[sys.executable, "-c", code]]
        else:
            runs = [["bash", "-c", f"cd {tmp_path} && {command}"] for command in shell_commands(code)]
        for run in runs:
            result = subprocess.run(
                run, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600, check=False
            )
            assert result.returncode == 0, (
                f"{doc}: {run[-1]}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            )
