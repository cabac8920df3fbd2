"""Qwen-Image-Layered through the front doors, on a checkpoint written by diffusers' own classes: the
`qwen-image layers IMAGE -o DIR` command (one PNG per layer) and the HTTP server's `/v1/images/edits` with
the `layers` extension field (the official openai client) each give the Python API's bytes; a misfit is one
clear line."""

import base64
import io
import os
import subprocess
import sys
from pathlib import Path

import openai
import PIL.Image
import pytest
from edit_fixtures import drawn_image
from gradio_client import Client, handle_file
from helpers import REPO, png_sha256
from layered_fixtures import build_layered_checkpoint
from test_control_front_ends import openai_client

import qwen_image_fusion.models.qwen_image_layered.caption as caption_module
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.cli import main
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.uploads import upload_options

ARGS = dict(width=64, height=48, num_inference_steps=2, seed=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_layered_checkpoint(tmp_path_factory.mktemp("layfront") / "layered", seed=3)


@pytest.fixture(scope="module")
def pipe(checkpoint: Path):
    return load_pipeline(checkpoint, variant="reference", device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def photo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("photo") / "poster.png"
    drawn_image(80, 60, 4, "RGBA").save(path)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "qwen_image_fusion.ui.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def cli_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`qwen-image ARGS` through the CLI's main() in this process (the command's code, without a new
    process's imports and load: `layers` runs as its own process in tests/test_layered_buckets.py):
    (status, stdout, stderr)."""
    capsys.readouterr()
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_layers_command_writes_one_png_per_layer_with_the_api_bytes(
    pipe, checkpoint, photo, tmp_path, capsys
):
    out = tmp_path / "layers"
    status, _, err = cli_here(
        capsys, "layers", str(photo), "--prompt", "a poster", "--layers", "3", "--model", str(checkpoint),
        "--device", "cpu", "--dtype", "fp32", "--variant", "reference", "--width", "64", "--height", "48",
        "--steps", "2", "--seed", "5", "-o", str(out),
    )  # fmt: skip
    assert status == 0, err
    written = sorted(out.iterdir())
    assert [p.name for p in written] == ["layer-0.png", "layer-1.png", "layer-2.png"]
    expected = pipe.generate("a poster", image=PIL.Image.open(photo), layers=3, **ARGS)
    for path, image in zip(written, expected, strict=True):
        assert PIL.Image.open(path).mode == "RGBA"
        assert png_sha256(PIL.Image.open(path)) == png_sha256(image)


def test_layers_command_refusals_are_one_line(checkpoint, photo, tmp_path):
    cases = [
        (["--model", str(checkpoint), "--layers", "0"], "layers must be an integer in 1..16"),
        (["--model", str(checkpoint), "--resolution", "640", "--width", "64"], "either resolution"),
        ([], "does not decompose images into layers"),  # the embedded text-to-image model
    ]
    for extra, message in cases:
        result = run_cli("layers", str(photo), "--prompt", "a poster", "-o", str(tmp_path / "o"), *extra)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_openai_client_asks_for_layers_as_an_extension_field(pipe, photo):
    with openai_client(pipe) as client, open(photo, "rb") as file:
        response = client.images.edit(
            image=file, prompt="a poster", size="64x48", extra_body={"layers": 2, "seed": 5,
                                                                    "num_inference_steps": 2},
        )  # fmt: skip
        got = [PIL.Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in response.data]
        expected = pipe.generate("a poster", image=PIL.Image.open(photo), layers=2, **ARGS)
        assert len(got) == 2 and {g.mode for g in got} == {"RGBA"}
        assert [png_sha256(g) for g in got] == [png_sha256(e) for e in expected]
        with open(photo, "rb") as again, pytest.raises(openai.BadRequestError) as caught:
            client.images.edit(image=again, prompt="a poster", size="64x48", extra_body={"layers": 99})
        error = caught.value.body.get("error", caught.value.body)
        assert error["param"] == "layers" and "1..16" in error["message"], error


@pytest.mark.slow
def test_demo_layers_tab_gives_the_python_api_layers(pipe, photo):
    app = build_app(pipe, Limits.for_device("cpu"))
    _, url, _ = app.launch(
        server_name="127.0.0.1", prevent_thread_lock=True, quiet=True, **upload_options(True)
    )
    try:
        client = Client(url, verbose=False, analytics_enabled=False)
        images, seed, details = client.predict(
            prompt="a poster", negative_prompt="", size="custom", width=64, height=48, num_inference_steps=2,
            true_cfg_scale=4.0, seed=5, randomize_seed=False, num_images=1, image_1=handle_file(photo),
            layers=3, variant=pipe.variant, api_name="/edit",
        )  # fmt: skip
    finally:
        app.close()
    expected = pipe.generate("a poster", image=PIL.Image.open(photo), layers=3, **ARGS)
    assert [png_sha256(PIL.Image.open(i["image"])) for i in images] == [png_sha256(e) for e in expected]
    assert seed == 5 and "2 steps" in details


def test_an_empty_prompt_is_captioned_through_the_cli_and_http(
    pipe, checkpoint, photo, tmp_path, capsys, monkeypatch
):
    """Captions of at most 32 tokens (diffusers' 512 are test_layered.py's, against diffusers): each front
    end passes the request on, whatever the caption's length."""
    monkeypatch.setattr(caption_module, "MAX_CAPTION_TOKENS", 32)
    expected = pipe.generate("", image=PIL.Image.open(photo), layers=2, use_en_prompt=True, **ARGS)
    caption = pipe.last_run.caption
    assert caption
    out = tmp_path / "captioned"
    status, stdout, err = cli_here(
        capsys, "layers", str(photo), "--use-en-prompt", "--layers", "2", "--model", str(checkpoint),
        "--device", "cpu", "--dtype", "fp32", "--variant", "reference", "--width", "64", "--height", "48",
        "--steps", "2", "--seed", "5", "-o", str(out),
    )  # fmt: skip
    assert status == 0, err
    printed = f"caption (the model's, for the empty prompt): {caption}"
    assert printed in stdout
    assert [png_sha256(PIL.Image.open(p)) for p in sorted(out.iterdir())] == [png_sha256(e) for e in expected]
    with openai_client(pipe) as client, open(photo, "rb") as file:
        body = {"layers": 2, "seed": 5, "num_inference_steps": 2, "use_en_prompt": "true"}
        response = client.images.edit(image=file, prompt="", size="64x48", extra_body=body)
        got = [PIL.Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in response.data]
        assert [png_sha256(g) for g in got] == [png_sha256(e) for e in expected]
