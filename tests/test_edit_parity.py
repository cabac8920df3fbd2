"""`python -m qwen_image_fusion.eval.parity` over edit sets (image + instruction pairs): on an FP8
Edit-2511-like checkpoint the fused producers reproduce the unfused PNG bytes edit by edit, the report names
each pair's input images, and a set the model cannot run is refused in one line before any worker starts."""

import json
import os
from pathlib import Path

import pytest
from edit_fixtures import SMALL_CONDITION_AREA, SMALL_VAE_AREA, build_edit_checkpoint, drawn_image
from helpers import REPO

from qwen_image_fusion.eval.parity import main
from qwen_image_fusion.eval.prompts import load_prompts
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint
from qwen_image_fusion.pipelines.requests import builtin_edit_set


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A BF16 Plus checkpoint with zero_cond_t and its FP8 export (calibrated on one built-in pair)."""
    root = tmp_path_factory.mktemp("edit-parity")
    bf16 = build_edit_checkpoint(root / "bf16", "QwenImageEditPlusPipeline", True, seed=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("qwen_image_fusion.models.qwen_image_edit.model.VAE_AREA", SMALL_VAE_AREA)
        patch.setattr("qwen_image_fusion.models.qwen_image_edit.model.CONDITION_AREA", SMALL_CONDITION_AREA)
        fp8 = quantize_checkpoint(bf16, root / "fp8", builtin_edit_set("edit")[:1], steps=2, size=32)
    return {"bf16": bf16, "fp8": fp8}


@pytest.fixture(scope="module")
def edit_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One edit of two small images (the models resize each to about 1024x1024 pixels for the VAE)."""
    root = tmp_path_factory.mktemp("set")
    drawn_image(40, 30, 1).save(root / "one.png")
    drawn_image(24, 36, 2, "RGBA").save(root / "two.png")
    path = root / "edits.jsonl"
    path.write_text(json.dumps({"prompt": "put 1 beside 2", "images": ["one.png", "two.png"]}) + "\n")
    return path


def parity_with_small_areas(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """`python -m qwen_image_fusion.eval.parity ARGV` run here (it only checks the requests and drives the
    workers), its workers started with the Edit model at the tests' small image areas: a `sitecustomize`
    module sets them, the checkout first on the path."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import qwen_image_fusion.models.qwen_image_edit.config as config\n"
        "import qwen_image_fusion.models.qwen_image_edit.model as model\n"
        f"model.VAE_AREA, model.CONDITION_AREA = {SMALL_VAE_AREA}, {SMALL_CONDITION_AREA}\n"
        f"config.VAE_AREA = {SMALL_VAE_AREA}\n"  # the default output size: an inpainting edit's size
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(REPO)]))
    return main(argv)


@pytest.mark.cpu_dtype
@pytest.mark.slow
def test_fp8_fused_equals_unfused_over_an_edit_set(
    checkpoints, edit_set, tmp_path, monkeypatch, capfd
) -> None:
    out = tmp_path / "out"
    argv = ["--model", str(checkpoints["fp8"]), "--prompts", str(edit_set), "--a", "fp8-unfused",
            "--b", "fp8-fused", "--size", "32x32", "--steps", "2", "--negative-prompt", " ",
            "--out", str(out), "--expect", "identical"]  # fmt: skip
    status = parity_with_small_areas(argv, tmp_path, monkeypatch)
    stdout, stderr = capfd.readouterr()
    assert status == 0, stderr[-3000:]
    assert "verdict: PASS (identical on all 1 pairs)" in stdout
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    (pair,) = report["pairs"]
    assert pair["images"] == [str(edit_set.parent / "one.png"), str(edit_set.parent / "two.png")]
    assert pair["png_identical"] and (pair["width"], pair["height"]) == (32, 32)
    fused = report["variants"]["b"]["workers"][0]["fusion_summary"].splitlines()[0]
    layers = json.loads((checkpoints["fp8"] / "transformer" / "config.json").read_text())["num_layers"]
    assert fused == f"FP8 norm+quant fusion: {4 * layers}/{4 * layers} block paths"
    assert "images: one.png, two.png" in (out / "report.html").read_text(encoding="utf-8")


def test_sets_the_model_cannot_run_are_refused_before_workers_start(checkpoints, edit_set, capsys) -> None:
    bf16 = checkpoints["bf16"]
    cases = {
        (
            str(bf16),
            "smoke",
        ): f"request 1 ({load_prompts('smoke')[0][:40]!r}): {bf16} works on input images: give at "
        "least one input image",
        (
            None,
            "edit",
        ): f"request 1 ({builtin_edit_set('edit')[0].prompt[:40]!r}): embedded-default generates "
        "from text only and takes no input images",
        (
            None,
            "nonsense",
        ): "prompt file not found: nonsense (built-in sets: diverse, smoke, edit, edit-plus, img2img, "
        "inpaint, control, control-inpaint, edit-inpaint)",
        (
            str(bf16),
            "edit-inpaint",
        ): f"request 1 ({builtin_edit_set('edit-inpaint')[0].prompt[:40]!r}): {bf16} does not inpaint its "
        "input image (a mask with images)",
    }
    for (model, prompts), message in cases.items():
        args = ["--prompts", prompts, "--a", "reference", "--b", "reference"]
        assert main([*args, *(["--model", model] if model else [])]) == 2
        assert capsys.readouterr().err.strip() == f"error: {message}"


@pytest.mark.cpu_dtype
@pytest.mark.slow
def test_fp8_fused_equals_unfused_over_the_edit_inpaint_set(tmp_path, monkeypatch, capfd) -> None:
    """The built-in `edit-inpaint` set (drawn images, their masks, strength 0.9) on a one-image Edit FP8
    export: each inpainting edit's PNG is the same fused and unfused."""
    bf16 = build_edit_checkpoint(tmp_path / "bf16", "QwenImageEditPipeline", False, seed=6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("qwen_image_fusion.models.qwen_image_edit.model.VAE_AREA", SMALL_VAE_AREA)
        patch.setattr("qwen_image_fusion.models.qwen_image_edit.model.CONDITION_AREA", SMALL_CONDITION_AREA)
        fp8 = quantize_checkpoint(bf16, tmp_path / "fp8", builtin_edit_set("edit")[:1], steps=2, size=32)
    out = tmp_path / "out"
    argv = ["--model", str(fp8), "--prompts", "edit-inpaint", "--a", "fp8-unfused", "--b", "fp8-fused",
            "--steps", "2", "--negative-prompt", " ", "--out", str(out), "--expect", "identical"]  # fmt: skip
    status = parity_with_small_areas(argv, tmp_path, monkeypatch)
    stdout, stderr = capfd.readouterr()
    assert status == 0, stderr[-3000:]
    assert "verdict: PASS (identical on all 6 pairs)" in stdout
    pairs = json.loads((out / "report.json").read_text(encoding="utf-8"))["pairs"]
    assert all(p["mask"] and p["images"] and p["init_image"] is None for p in pairs)
    assert len({p["a"]["png_sha256"] for p in pairs}) == 6
