"""The `qwen-image` command as a user runs it: images written, info printed, one-line errors."""

import json
import shutil
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
from helpers import REPO

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "qwen_image_fusion.ui.cli",
        *args,
    ]  # from the checkout, not an installed copy
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, cwd=REPO)


@pytest.mark.cpu_dtype
def test_generate_writes_a_png_with_no_model_given(tmp_path, capsys):
    """Through main() here: `qwen-image generate` with no model runs as its own process in README command
    1 (tests/test_docs_examples.py) and in test_packaging.py."""
    out = tmp_path / "fox.png"
    status = main(["generate", "a red fox", "-o", str(out), "--width", "64", "--height", "48", "--steps=2"])
    stdout, stderr = capsys.readouterr()
    assert status == 0, stderr
    image = PIL.Image.open(out)
    assert image.size == (64, 48) and image.format == "PNG"
    assert np.asarray(image).std() > 0
    assert "seed" in stdout and "ms/step" in stdout
    assert "denoising" in stderr  # progress bar over steps


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "   "], "prompt is empty"),
        (["generate", "fox", "--width", "100"], "width 100 must be a multiple of 16"),
        (["generate", "fox", "--height", "4096"], "height 4096 must be a multiple of 16 between 16 and 2048"),
        (["generate", "fox", "--steps", "0"], "num_inference_steps 0 must be between 2 and 200"),
        (
            ["generate", "fox", "--model", "/nonexistent/qwen"],
            "model directory /nonexistent/qwen does not exist",
        ),
        (
            ["info", "--variant", "fp8-fused"],
            "variant 'fp8-fused' needs FP8 weights, and this checkpoint has BF16",
        ),
        (["generate", "fox", "-o", "out"], "output out needs an image extension such as .png"),
        (["quantize", "--out", __file__], "exists and is not an empty directory"),
    ],
)
def test_bad_input_gives_one_line_error(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt") / "qwen"
    pipe = load_pipeline(device="cpu")
    pipe.model.save(directory, (), pipe.defaults)  # a checkpoint keeps the defaults of its source
    return directory


@pytest.mark.cpu_dtype
def test_saved_checkpoint_round_trips_and_info_describes_it(saved_model, tmp_path, capsys):
    embedded = load_pipeline(device="cpu")
    loaded = load_pipeline(saved_model, device="cpu")
    args = dict(width=32, height=32, num_inference_steps=2, seed=5)
    a, b = embedded.generate("a boat", **args)[0], loaded.generate("a boat", **args)[0]
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert main(["info", "--model", str(saved_model)]) == 0
    out = capsys.readouterr().out
    layers = embedded.transformer.config.num_layers
    assert "transformer:" in out and f"{layers} layers" in out and "FP8 norm+quant fusion: off" in out
    assert "quantization: none (BF16 weights)" in out


@pytest.mark.cpu_dtype
def test_partial_and_mismatched_checkpoints_are_refused(saved_model, tmp_path, capsys):
    partial = tmp_path / "partial"
    shutil.copytree(saved_model, partial)
    shutil.rmtree(partial / "vae")
    assert main(["info", "--model", str(partial)]) == 2
    assert "incomplete: missing vae/" in capsys.readouterr().err

    wrong = tmp_path / "wrong"
    shutil.copytree(saved_model, wrong)
    config_path = wrong / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["num_attention_heads"] = 4
    config["attention_head_dim"] = 16
    config["axes_dims_rope"] = [4, 6, 6]
    config_path.write_text(json.dumps(config))
    assert main(["info", "--model", str(wrong)]) == 2
    err = capsys.readouterr().err
    assert "has shape" in err and "expected" in err


def test_unreadable_calibration_prompts_give_one_line_error(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"\xff\xfe not utf-8 \x80")
    assert main(["quantize", "--out", str(tmp_path / "q"), "--calib-prompts", str(prompts)]) == 2
    assert "cannot read prompt file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed", "-3"], "seed -3 must be an integer in [0, 2**63)"),
        (["--true-cfg-scale", "nan"], "true_cfg_scale nan must be a finite number >= 0"),
        (["--num-images", "17"], "num_images_per_prompt 17 must be between 1 and 16"),
        (["--max-sequence-length", "0"], "max_sequence_length 0 must be between 1 and 1024"),
        (["--width", "40"], "width 40 must be a multiple of 16 between 16 and 2048"),
    ],
)
def test_generation_arguments_fail_before_any_model_loads(args, message, tmp_path, monkeypatch, capsys):
    """The checks run before loading: loading would fail the test. The line names the flag."""
    monkeypatch.setattr(
        "qwen_image_fusion.ui.commands.load", lambda _args: pytest.fail("the model loaded before the checks")
    )
    assert main(["generate", "a fox", "-o", str(tmp_path / "a.png"), *args]) == 2
    assert capsys.readouterr().err.strip() == f"error: {args[0]}: {message}"


def test_bad_size_is_refused_in_under_a_second_with_the_checkpoints_own_multiple(saved_model, tmp_path):
    """Sides are checked against the checkpoint's VAE scale (read from vae/config.json, nothing loaded)."""
    config_path = saved_model / "vae" / "config.json"
    config = json.loads(config_path.read_text())
    assert len(config["temperal_downsample"]) == 3  # 8x: sides are multiples of 16
    result = run_cli("generate", "a fox", "--model", str(saved_model), "--width", "40", "-o", "x.png")
    assert result.returncode == 2 and result.stderr.strip().endswith(
        "--width: width 40 must be a multiple of 16 between 16 and 2048"
    )


def test_help_shows_every_default():
    for command, expected in {
        "generate": [
            "(default: out.png)",
            "(default: 512)",
            "(default: the model's, 4)",
            "default: bf16 where the device computes it natively",
            "1024 for Qwen-Image",
        ],
        "quantize": ["(default: the embedded model)", "at most 20"],
    }.items():
        help_text = run_cli(command, "--help").stdout
        flat = " ".join(help_text.split())
        for text in expected:
            assert text in flat, (command, text)


@pytest.mark.cpu_dtype
def test_a_prompt_cut_at_max_sequence_length_warns_how_many_tokens_were_dropped(tmp_path, capsys):
    prompt = " ".join(["fox"] * 40)
    args = ["generate", prompt, "-o", str(tmp_path / "a.png"), "--width", "32", "--height", "32"]
    status = main([*args, "--steps", "2", "--max-sequence-length", "16"])
    stderr = capsys.readouterr().err
    assert status == 0, stderr
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: ")]
    # 40 words + the template's 5 closing tokens = 45 kept tokens before the cut; 16 stay.
    expected = (
        "prompt 1 is 45 tokens with the template's end: the 29 past max_sequence_length 16 were dropped"
    )
    assert warnings == [f"warning: {expected}"]


@pytest.mark.cpu_dtype
def test_loading_a_checkpoint_prints_no_library_progress_bars(saved_model):
    result = run_cli("info", "--model", str(saved_model))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines() == [f"loading {saved_model} ..."], result.stderr
