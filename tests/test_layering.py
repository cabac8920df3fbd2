"""Imports flow one way (kernels <- models <- pipelines <- ui / eval <- training, bench), with no circles.

Every import statement of every module counts, also those inside functions: a lazy import still ties the
two modules together.
"""

import ast
from pathlib import Path

from helpers import REPO

PACKAGES = ("kernels", "models", "pipelines", "ui", "eval", "training")
ROOT = "qwen_image_fusion"  # the import name the folders install under (pyproject's package-dir)
MAY_IMPORT = {
    "kernels": {"kernels"},
    "models": {"kernels", "models"},
    "pipelines": {"kernels", "models", "pipelines"},
    "ui": {"kernels", "models", "pipelines", "ui"},
    "eval": {"kernels", "models", "pipelines", "eval"},
    "training": {"kernels", "models", "pipelines", "eval", "training"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join((ROOT, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def layer(module: str) -> str:
    """The folder a module lives in: `kernels` for `qwen_image_fusion.kernels.seam`."""
    return module.split(".")[1]


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (for `from a.b import c`, module a.b.c when it exists, else a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            }
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    files = [p for package in PACKAGES for p in (REPO / package).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): project_imports(p, modules) for p in files}


def test_every_import_points_down_the_layers() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the walk found the project
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if layer(target) not in MAY_IMPORT[layer(module)]
    )
    assert not wrong, wrong


def test_no_import_circles() -> None:
    graph = import_graph()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target == module:
                continue
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not circles, [" -> ".join(c) for c in circles]
