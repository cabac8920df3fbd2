"""One import name: every module is `qwen_image_fusion.*`, and the old bare names cannot come back.

The six folders at the checkout's top install as `qwen_image_fusion.<folder>` (pyproject's package-dir).
An `import models` or `-m ui.cli` would only work from the checkout, and would shadow (or be shadowed by)
any other package of that generic name, Hugging Face's `kernels` first of all: transformers imports it.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, tracked

BARE = ("models", "kernels", "pipelines", "ui", "eval", "training")
ROOT = "qwen_image_fusion"
# A string that names a module by its old path: `ui.cli`, `pipelines.pipeline.load`, `-m eval.parity`.
BARE_MODULE_STRING = re.compile(rf"(?:^|-m\s+)(?:{'|'.join(BARE)})\.[A-Za-z_][\w.]*$")
# The same in prose and shell: `from pipelines import`, `import models.`, `python -m ui.cli`.
BARE_IN_TEXT = re.compile(
    rf"(?:\bfrom\s+(?:{'|'.join(BARE)})(?:\.\w+)*\s+import\b"
    rf"|^\s*import\s+(?:{'|'.join(BARE)})\b"
    rf"|-m\s+(?:{'|'.join(BARE)})\.\w)",
    re.MULTILINE,
)


def is_bare(module: str) -> bool:
    return module.split(".")[0] in BARE


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants, whose prose may name a folder by its path."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def bare_names_in_python(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree)
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wrong += [f"import {a.name}" for a in node.names if is_bare(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and is_bare(node.module):
            wrong.append(f"from {node.module} import")
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            wrong.append(f"relative import from {'.' * node.level}{node.module or ''}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in skip
            and BARE_MODULE_STRING.search(node.value.strip())
        ):
            wrong.append(f"string {node.value.strip()!r}")
    return wrong


def test_no_python_file_names_a_bare_module() -> None:
    files = tracked("*.py")
    assert len(files) > 200  # the listing found the checkout's code, tests and benchmarks
    wrong = [f"{path.relative_to(REPO)}: {entry}" for path in files for entry in bare_names_in_python(path)]
    assert not wrong, wrong


def test_no_doc_or_script_names_a_bare_module() -> None:
    files = tracked("*.md", "*.sh", ".ci/run")
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".sh" for p in files)
    wrong = [
        f"{path.relative_to(REPO)}: {match.group(0).strip()}"
        for path in files
        if "bench/results" not in path.as_posix()  # raw logs of earlier sessions, kept as they were
        for match in BARE_IN_TEXT.finditer(path.read_text(errors="replace"))
    ]
    assert not wrong, wrong


@pytest.mark.parametrize(
    ("old", "package"),
    [
        ("from pipelines import load_pipeline", "pipelines"),
        ("import models.qwen_image.transformer", "models"),
        ("python -m ui.cli generate", "ui"),
    ],
)
def test_the_text_scan_catches_an_old_name_and_passes_the_new(old: str, package: str) -> None:
    assert BARE_IN_TEXT.search(old)
    assert not BARE_IN_TEXT.search(old.replace(package, f"{ROOT}.{package}", 1))


def test_the_code_scan_catches_an_old_name(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""Docs may say pipelines.pipeline.load."""\n'
        "import kernels.seam\nfrom eval.metrics import psnr\nfrom . import sibling\n"
        'TARGET = "pipelines.pipeline.load"\nRELAUNCH = "-m ui.cli"\n'
        'FINE = "qwen_image_fusion.ui.cli"\n'
    )
    assert bare_names_in_python(probe) == [
        "import kernels.seam",
        "from eval.metrics import",
        "relative import from .",
        "string 'pipelines.pipeline.load'",
        "string '-m ui.cli'",
    ]


def test_from_the_checkout_kernels_is_hugging_faces_and_ours_is_under_the_one_name() -> None:
    """Run from the repository root with the root on sys.path (as pytest and `python -m` from it do):
    `kernels` must be the installed Hugging Face package, transformers' model code must import, and our
    kernels must import by their full name."""
    probe = (
        "import sys, kernels, transformers.modeling_utils, qwen_image_fusion.kernels.seam as seam\n"
        "print(kernels.__file__); print(seam.__file__); print(transformers.__version__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    hub_kernels, ours, _version = result.stdout.split()
    assert "site-packages" in hub_kernels or "dist-packages" in hub_kernels, hub_kernels
    assert not Path(hub_kernels).is_relative_to(REPO)
    assert Path(ours).resolve() == (REPO / "kernels" / "seam.py").resolve()
