"""ControlNet through every front door, on a checkpoint written by diffusers' own QwenImageControlNetModel:
the `qwen-image generate --control-image` command, the HTTP server's `control_image` extension field (the
official openai client), and the demo's Image-to-image tab with the image as a control map or its canny
edges: each gives the Python API's bytes, and a misfit is one clear line."""

import base64
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import PIL.Image
import pytest
import torch
from controlnet_fixtures import build_controlnet_checkpoint, depth_map, edge_map
from gradio_client import Client, handle_file
from gradio_client.exceptions import ValidationError
from helpers import REPO, png_sha256

from bench.in_thread import InThread
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.runner import Runner
from qwen_image_fusion.ui.server import build_server
from qwen_image_fusion.ui.uploads import upload_options

ARGS = dict(width=64, height=48, num_inference_steps=3, seed=6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_controlnet_checkpoint(tmp_path_factory.mktemp("cnfront") / "cn")


@pytest.fixture(scope="module")
def pipe(checkpoint: Path) -> Iterator[Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_pipeline(checkpoint, variant="reference", device="cpu", dtype="fp32")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def maps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("maps")
    paths = {"edges": root / "edges.png", "depth": root / "depth.jpg", "photo": root / "photo.png"}
    edge_map(64, 48, seed=9).save(paths["edges"])
    depth_map(64, 48).save(paths["depth"], quality=95)  # a JPEG, as a depth estimator's output may be
    PIL.Image.open(REPO / "pipelines/edit_sets/images/scene-00.png").resize((64, 48)).save(paths["photo"])
    return paths


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The command in a process of one torch thread, as the in-process pipelines here run (CPU kernels may
    sum in another order on more threads)."""
    command = [sys.executable, "-m", "qwen_image_fusion.ui.cli", *args]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=600, check=False, cwd=REPO, env=env
    )


def test_cli_generates_with_two_control_maps_as_the_python_api_does(pipe, checkpoint, maps, tmp_path):
    out = tmp_path / "out.png"
    result = run_cli(
        "generate", "a house by a lake", "-o", str(out), "--model", str(checkpoint), "--variant", "reference",
        "--dtype", "fp32", "--width", "64", "--height", "48", "--steps", "3", "--seed", "6",
        "--control-image", str(maps["edges"]), "--control-image", str(maps["depth"]),
        "--control-scale", "0.8", "--control-scale", "0.5", "--control-end", "0.7",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    images = [PIL.Image.open(maps[name]) for name in ("edges", "depth")]
    expected = pipe.generate(
        "a house by a lake", control_image=images, controlnet_conditioning_scale=[0.8, 0.5],
        control_guidance_end=0.7, **ARGS,
    )  # fmt: skip
    assert png_sha256(PIL.Image.open(out)) == png_sha256(expected[0])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--control-scale", "0.5", "0.5"], "unrecognized arguments"),
        (
            ["--control-scale", "0.5", "--control-scale", "0.4", "--control-scale", "0.3"],
            "has 3 values for 1",
        ),
        (["--control-mode", "depth"], "invalid choice: 'depth'"),
        (["--width", "48", "--height", "64"], "would be stretched"),
        (["--init-image", "MAP"], "control_image does not combine with init_image"),
    ],
)
def test_cli_refuses_bad_control_in_one_line(checkpoint, maps, tmp_path, args, message):
    args = [str(maps["edges"]) if a == "MAP" else a for a in args]
    result = run_cli(
        "generate", "a fox", "-o", str(tmp_path / "x.png"), "--model", str(checkpoint),
        "--control-image", str(maps["edges"]), *args,
    )  # fmt: skip
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "x.png").exists()


def test_cli_refuses_control_for_a_model_without_controlnet(maps, tmp_path):
    result = run_cli(
        "generate", "a fox", "-o", str(tmp_path / "x.png"), "--control-image", str(maps["edges"])
    )
    assert result.returncode == 2 and "needs a ControlNet" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode("ascii")


@contextmanager
def openai_client(pipe) -> Iterator[openai.OpenAI]:
    """The official client of a server for `pipe` on 127.0.0.1 (requests alone, the CPU's limits)."""
    runner = Runner(pipe, Limits.for_device("cpu"))
    server = InThread(build_server(pipe, runner))
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    finally:
        server.close()
        runner.close()


def test_openai_client_sends_control_maps_as_extension_fields(pipe, maps):
    with openai_client(pipe) as client:
        extra = {
            "seed": 6,
            "num_inference_steps": 3,
            "control_image": [_b64(maps["photo"]), "data:image/jpeg;base64," + _b64(maps["depth"])],
            "control_mode": "canny",
            "controlnet_conditioning_scale": [0.7, 0.4],
        }
        response = client.images.generate(prompt="a red square", size="64x48", extra_body=extra)
        got = PIL.Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
        images = [PIL.Image.open(maps[name]) for name in ("photo", "depth")]
        expected = pipe.generate(
            "a red square", control_image=images, control_mode="canny",
            controlnet_conditioning_scale=[0.7, 0.4], **ARGS,
        )  # fmt: skip
        assert png_sha256(got) == png_sha256(expected[0])
        edges = _b64(maps["edges"])
        refusals = [
            ({"control_image": "not base64!"}, "control_image", "is not base64"),
            ({"control_image": edges, "control_mode": "pose"}, "control_mode", "the pose map"),
            ({"control_image": edges, "control_guidance_end": 2}, "control_guidance_end", "[0, 1]"),
            ({"control_image": [edges], "controlnet_conditioning_scale": [1, 2]},
             "controlnet_conditioning_scale", "has 2 values"),
        ]  # fmt: skip
        for body, param, message in refusals:
            with pytest.raises(openai.BadRequestError) as caught:
                client.images.generate(prompt="x", size="64x48", extra_body=body)
            error = caught.value.body
            assert error["param"] == param and message in error["message"], error


@pytest.fixture(scope="module")
def demo(pipe) -> Iterator[str]:
    app = build_app(pipe, Limits.for_device("cpu"))
    _, url, _ = app.launch(
        server_name="127.0.0.1", prevent_thread_lock=True, quiet=True, **upload_options(True)
    )
    try:
        yield url
    finally:
        app.close()


FORM = dict(prompt="a red circle", negative_prompt="blurry", size="custom", width=64, height=48,
            num_inference_steps=3, true_cfg_scale=4.0, seed=6, randomize_seed=False,
            num_images=1)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("role", ["control map", "canny edges"])
def test_demo_guides_by_the_image_as_the_python_api_does(pipe, demo, maps, role):
    client = Client(demo, verbose=False, analytics_enabled=False)
    image = maps["edges" if role == "control map" else "photo"]
    images, seed, details = client.predict(
        **FORM, image_1=handle_file(image), mask=None, role=role, control_scale=0.9, variant=pipe.variant,
        api_name="/edit",
    )  # fmt: skip
    expected = pipe.generate(
        "a red circle", negative_prompt="blurry", true_cfg_scale=4.0, control_image=PIL.Image.open(image),
        control_mode=None if role == "control map" else "canny", controlnet_conditioning_scale=0.9, **ARGS,
    )  # fmt: skip
    assert [png_sha256(PIL.Image.open(i["image"])) for i in images] == [png_sha256(e) for e in expected]
    assert seed == 6 and "3 steps" in details
    with pytest.raises(ValidationError, match="a mask applies to a start image"):
        client.predict(
            **FORM, image_1=handle_file(image), mask=handle_file(maps["edges"]), role=role, control_scale=0.9,
            variant=pipe.variant, api_name="/edit",
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.browser
def test_page_generates_from_an_uploaded_control_map(demo, maps, tmp_path) -> None:
    from helpers import CHROMIUM
    from playwright import sync_api
    from test_ui_served import CHROMIUM_ARGS, _screenshot

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        page.goto(demo)
        expect = sync_api.expect
        page.get_by_role("tab", name="Image to image").click()
        page.locator("#edit_image_1 input[type=file]").set_input_files(str(maps["edges"]))
        page.locator("#edit_role").get_by_label("control map").check()
        page.locator("#edit_prompt textarea").fill("a red circle")
        for field, value in (("width input", 64), ("height input", 48), ("steps input[type=number]", 3)):
            box = page.locator(f"#edit_{field}")
            box.fill(str(value))
            box.blur()
        page.locator("#edit").click()
        expect(page.locator("#edit_details")).to_contain_text("3 steps", timeout=120_000)
        image = page.locator("#edit_details").locator("xpath=../..").locator("img").first
        expect(image).to_be_visible()
        _screenshot(page, tmp_path / "ui_control.png")
        browser.close()


@pytest.fixture()
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_an_inpainting_controlnet_through_the_cli_and_http(tmp_path, one_thread):
    """`--control-mask` and the `control_mask` field reach an inpainting ControlNet: the Python API's bytes
    (one torch thread, as the command runs)."""
    checkpoint = build_controlnet_checkpoint(tmp_path / "inpaint", seed=8, inpaint=True)
    pipe = load_pipeline(checkpoint, variant="reference", device="cpu", dtype="fp32")
    image, mask = tmp_path / "photo.png", tmp_path / "mask.png"
    PIL.Image.open(REPO / "pipelines/edit_sets/images/scene-00.png").resize((64, 48)).save(image)
    PIL.Image.open(REPO / "pipelines/edit_sets/masks/mask-00.png").resize((64, 48)).save(mask)
    expected = pipe.generate(
        "a red star", control_image=PIL.Image.open(image), control_mask=PIL.Image.open(mask), **ARGS
    )
    out = tmp_path / "out.png"
    result = run_cli(
        "generate", "a red star", "-o", str(out), "--model", str(checkpoint), "--variant", "reference",
        "--dtype", "fp32", "--width", "64", "--height", "48", "--steps", "3", "--seed", "6",
        "--control-image", str(image), "--control-mask", str(mask),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert png_sha256(PIL.Image.open(out)) == png_sha256(expected[0])
    with openai_client(pipe) as client:
        extra = {
            "seed": 6,
            "num_inference_steps": 3,
            "control_image": _b64(image),
            "control_mask": _b64(mask),
        }
        response = client.images.generate(prompt="a red star", size="64x48", extra_body=extra)
        got = PIL.Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
        assert png_sha256(got) == png_sha256(expected[0])
        with pytest.raises(openai.BadRequestError) as caught:
            client.images.generate(prompt="x", size="64x48", extra_body={"control_image": _b64(image)})
        assert caught.value.body["param"] == "control_mask"
