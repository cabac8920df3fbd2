"""`qwen-image edit` as a user runs it: the edited PNG is what the Python API gives for the same images and
arguments, and every bad request (a non-image file, a truncated PNG, more images than the model takes, an
image above the pixel cap, a text-only checkpoint asked to edit, an Edit checkpoint asked to generate) is
one `error:` line, exit status 2, before any model loads or torch is imported."""

import subprocess
import sys
from pathlib import Path

import PIL.Image
import pytest
from edit_fixtures import (
    SMALL_CONDITION_AREA,
    SMALL_VAE_AREA,
    build_edit_checkpoints,
    drawn_image,
    our_edit_pipeline,
)
from helpers import REPO, png_sha256

from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.pipelines.memory_plan import gib, minimum_budget
from qwen_image_fusion.ui.cli import main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_edit_checkpoints(tmp_path_factory.mktemp("edit-cli"), {"edit": 1, "plus-2511": 2})


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Input files: two drawn images, a text file named .png, a PNG cut in half, a 5000x4000 PNG."""
    root = tmp_path_factory.mktemp("inputs")
    paths = {name: root / f"{name}.png" for name in ("a", "b", "text", "truncated", "huge")}
    drawn_image(75, 53, 1).save(paths["a"])
    drawn_image(50, 70, 2, "P").save(paths["b"])
    paths["text"].write_text("not an image")
    paths["truncated"].write_bytes(paths["a"].read_bytes()[: paths["a"].stat().st_size // 2])
    PIL.Image.new("RGB", (5000, 4000), (10, 20, 30)).save(paths["huge"])
    return paths


def smallest_budget(directory: str, workload: Workload) -> str:
    """The planner's smallest budget for the tiny checkpoint (CUDA's reserve included), as errors print it."""
    spec = inspect_checkpoint(Path(directory))
    return gib(minimum_budget(spec.family.memory_profile(spec, 2, 2), workload))


def refusals(checkpoints: dict[str, Path], files: dict[str, Path]) -> dict[str, tuple[list[str], str]]:
    edit, plus = str(checkpoints["edit"]), str(checkpoints["plus-2511"])
    a = str(files["a"])
    request = Workload(1024, 1024, text_tokens=512, true_cfg=False, input_images=1)  # what `edit` asks here
    return {
        "not an image": (
            ["edit", "x", "--image", str(files["text"]), "--model", plus],
            f"--image: input image {files['text']} is not an image Pillow can read (UnidentifiedImageError)",
        ),
        "truncated PNG": (
            ["edit", "x", "--image", str(files["truncated"]), "--model", plus],
            f"--image: input image {files['truncated']} is truncated or corrupt: image file is truncated",
        ),
        "missing file": (
            ["edit", "x", "--image", "/nonexistent/photo.png", "--model", plus],
            "--image: input image /nonexistent/photo.png does not exist",
        ),
        "too many images for Edit": (
            ["edit", "x", "--image", a, "--image", a, "--model", edit],
            f"--image: 2 input images, but {edit} takes at most 1",
        ),
        "too many images for Plus": (
            ["edit", "x", *["--image", a] * 4, "--model", plus],
            f"--image: 4 input images, but {plus} takes at most 3",
        ),
        "above the pixel cap": (
            ["edit", "x", "--image", str(files["huge"]), "--model", plus],
            f"--image: input image {files['huge']} is 5000x4000: at most 16.8 MP (4096x4096)",
        ),
        "text-only checkpoint asked to edit": (
            ["edit", "x", "--image", a],
            "embedded-default generates from text only and cannot edit images: give `qwen-image edit` a "
            "Qwen-Image-Edit checkpoint (its model_index.json names QwenImageEditPipeline or "
            "QwenImageEditPlusPipeline)",
        ),
        "Edit checkpoint asked to generate": (
            ["generate", "x", "--model", edit],
            f"{edit} edits images and cannot generate from text alone: run `qwen-image edit INSTRUCTION "
            "--image FILE` with it",
        ),
        "width not a multiple": (
            ["edit", "x", "--image", a, "--model", plus, "--width", "40"],
            "--width: width 40 must be a multiple of 16 between 16 and 2048",
        ),
        "a GPU-memory budget too small for the model": (
            ["edit", "x", "--image", a, "--model", plus, "--gpu-memory", "1MiB"],
            f"GPU memory 1 MiB cannot hold this model for {request.describe()}: it needs at least "
            f"{smallest_budget(plus, request)}",
        ),
    }


CASES = [
    "not an image",
    "truncated PNG",
    "missing file",
    "too many images for Edit",
    "too many images for Plus",
    "above the pixel cap",
    "text-only checkpoint asked to edit",
    "Edit checkpoint asked to generate",
    "width not a multiple",
    "a GPU-memory budget too small for the model",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_requests_fail_in_one_line_before_anything_loads(
    case, checkpoints, files, tmp_path, monkeypatch, capsys
):
    args, message = refusals(checkpoints, files)[case]
    monkeypatch.setattr(
        "qwen_image_fusion.ui.commands.load", lambda *_args: pytest.fail("the model loaded before the checks")
    )
    assert main([*args, "-o", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {message}"]


def test_refusals_import_nothing_heavy(checkpoints, files, tmp_path):
    """In a fresh interpreter: each refusal leaves torch unimported (and so no model loaded)."""
    cases = refusals(checkpoints, files)
    code = (
        "import sys\nfrom qwen_image_fusion.ui.cli import main\n"
        f"for args in {[cases[name][0] + ['-o', str(tmp_path / 'o.png')] for name in CASES]!r}:\n"
        "    assert main(args) == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("error: ") == len(CASES)


@pytest.mark.cpu_dtype
@pytest.mark.slow
def test_edit_writes_what_the_python_api_gives(checkpoints, files, tmp_path, monkeypatch, capsys):
    """Two images on an Edit-2511-like Plus checkpoint, true CFG, two outputs: the files are the PNG bytes of
    `pipe.generate(..., image=[...])` with the same arguments (both at the tests' small image areas)."""
    monkeypatch.setattr("qwen_image_fusion.models.qwen_image_edit.model.VAE_AREA", SMALL_VAE_AREA)
    monkeypatch.setattr("qwen_image_fusion.models.qwen_image_edit.model.CONDITION_AREA", SMALL_CONDITION_AREA)
    out = tmp_path / "edited.png"
    plus = checkpoints["plus-2511"]
    args = ["--width", "48", "--height", "32", "--steps", "2", "--seed", "7", "--num-images", "2"]
    command = ["edit", "put 2 beside 1", "--image", str(files["a"]), "--image", str(files["b"])]
    assert main([*command, *args, "--negative-prompt", " ", "--model", str(plus), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "image encoding" in printed and "wrote" in printed and "seed 7" in printed
    written = [PIL.Image.open(tmp_path / f"edited-{i}.png") for i in range(2)]
    pipe = our_edit_pipeline(plus, variant="auto", dtype=None)
    images = [PIL.Image.open(files["a"]), PIL.Image.open(files["b"])]
    expected = pipe.generate(
        "put 2 beside 1", image=images, negative_prompt=" ", width=48, height=32, num_inference_steps=2,
        seed=7, num_images_per_prompt=2,
    )  # fmt: skip
    assert [png_sha256(image) for image in written] == [png_sha256(image) for image in expected]
    assert all(image.size == (48, 32) for image in written)
