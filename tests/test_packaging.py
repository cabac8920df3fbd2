"""The wheel as a user gets it: built from the checkout's tracked files, it holds one top-level import name
and every file of the six folders (code, the embedded default's weights, prompt and edit sets); installed
with `--no-deps` into a folder beside this environment's dependencies but away from the checkout, every
module imports from that folder, and `qwen-image generate` and `qwen-image layers` give the checkout's
bytes.

The checkout is installed editable here (README command 2), and setuptools' editable finder would serve
any module the wheel lacks from the checkout; the installed copy runs with `python -S` (no `.pth` files)
and this environment's site-packages on PYTHONPATH behind it, so a file missing from the wheel fails.
"""

import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import PIL.Image
import pytest
from edit_fixtures import drawn_image
from helpers import REPO, png_sha256, tracked
from layered_fixtures import build_layered_checkpoint

from qwen_image_fusion.pipelines import load_pipeline

ROOT = "qwen_image_fusion"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
FOLDERS = {  # subpackage -> the checkout's folder, from pyproject's package-dir
    name.removeprefix(f"{ROOT}."): folder
    for name, folder in PROJECT["tool"]["setuptools"]["package-dir"].items()
}
PROMPT = "a red circle on the left and a blue square on the right"
LAYERS_ARGS = dict(width=64, height=48, num_inference_steps=2, seed=5)

# Every module of the installed copy imports from it; Hugging Face's `kernels`, which transformers'
# model code imports, is the installed distribution's, not ours.
IMPORT_ALL = """
import importlib, sys
from pathlib import Path
import kernels, transformers.modeling_utils
root = Path(sys.argv[1]) / "qwen_image_fusion"
names = sorted(".".join(p.relative_to(root.parent).with_suffix("").parts) for p in root.rglob("*.py"))
names = [name.removesuffix(".__init__") for name in names]
for name in names:
    where = Path(importlib.import_module(name).__file__).resolve()
    assert where.is_relative_to(root.resolve()), (name, where)
assert not Path(kernels.__file__).resolve().is_relative_to(root.resolve()), kernels.__file__
print(len(names))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a clean copy of the checkout's tracked files (what a fresh clone builds)."""
    source = tmp_path_factory.mktemp("source")
    for path in tracked():
        target = source / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    dist = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist)]
    subprocess.run([*build, "."], cwd=source, check=True, capture_output=True, timeout=300)
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("target")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def run_installed(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -S ...` seeing the installed copy first, then this environment's packages, from `cwd`."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(installed), *site.getsitepackages()])}
    return subprocess.run(
        [sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_wheel_has_one_top_level_name_and_every_tracked_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {ROOT}
    expected = {
        f"{ROOT}/{package.replace('.', '/')}/{path.relative_to(REPO / folder).as_posix()}"
        for package, folder in FOLDERS.items()
        for path in tracked(folder)
    }
    assert any(name.endswith(".safetensors") for name in expected)  # the embedded default's weights
    assert not expected - names, sorted(expected - names)
    assert not {name for name in names if name.startswith(f"{ROOT}/")} - expected
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert f"qwen-image = {ROOT}.ui.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_every_module_imports_from_the_installed_copy(installed: Path, tmp_path: Path) -> None:
    result = run_installed(installed, tmp_path, "-c", IMPORT_ALL, str(installed))
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) == len(tracked("*.py", ":!tests", ":!bench", ":!docs"))


def test_the_installed_command_generates_the_checkouts_image(installed: Path, tmp_path: Path) -> None:
    out = tmp_path / "first.png"
    result = run_installed(
        installed, tmp_path, str(installed / "bin" / "qwen-image"), "generate", PROMPT, "--seed", "0",
        "--dtype", "fp32", "--variant", "reference", "--width", "64", "--height", "48", "--steps", "4",
        "-o", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    pipe = load_pipeline(device="cpu", dtype="fp32", variant="reference")
    expected = pipe.generate(PROMPT, seed=0, width=64, height=48, num_inference_steps=4)
    assert png_sha256(PIL.Image.open(out)) == png_sha256(expected[0])


def test_the_installed_command_decomposes_layers_as_the_checkout(installed: Path, tmp_path: Path) -> None:
    checkpoint = build_layered_checkpoint(tmp_path / "layered", seed=3)
    photo = tmp_path / "poster.png"
    drawn_image(80, 60, 4, "RGBA").save(photo)
    out = tmp_path / "layers"
    result = run_installed(
        installed, tmp_path, str(installed / "bin" / "qwen-image"), "layers", str(photo),
        "--prompt", "a poster", "--layers", "3", "--model", str(checkpoint), "--device", "cpu",
        "--dtype", "fp32", "--variant", "reference", "--width", "64", "--height", "48", "--steps", "2",
        "--seed", "5", "-o", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    pipe = load_pipeline(checkpoint, variant="reference", device="cpu", dtype="fp32")
    expected = pipe.generate("a poster", image=PIL.Image.open(photo), layers=3, **LAYERS_ARGS)
    written = sorted(out.iterdir())
    assert [path.name for path in written] == [f"layer-{i}.png" for i in range(3)]
    assert [png_sha256(PIL.Image.open(path)) for path in written] == [png_sha256(im) for im in expected]
