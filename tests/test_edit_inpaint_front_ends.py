"""An inpainting edit (an Edit checkpoint, a mask, a strength, `padding_mask_crop`) through every front door:
`qwen-image edit --mask --strength --padding-mask-crop`, the HTTP server's /v1/images/edits with OpenAI's
`mask` and the extension fields (the official openai client), and the demo's "/edit" API: each gives the
Python API's PNG bytes. Bad input is one clear line, before any model loads (CLI) or the job queues: a mask of
another size than the image, `padding_mask_crop` without a mask, a mask for a Plus checkpoint (diffusers has
no Plus inpainting). Everything runs at the tests' small Edit image areas, in one torch thread."""

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import PIL.Image
import pytest
import torch
from edit_fixtures import (
    SMALL_CONDITION_AREA,
    SMALL_VAE_AREA,
    build_edit_checkpoints,
    drawn_image,
    our_edit_pipeline,
)
from gradio_client import Client, handle_file
from gradio_client.exceptions import ValidationError
from helpers import png_sha256
from test_control_front_ends import openai_client
from test_img2img_oracle import ellipse_mask

from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.cli import main
from qwen_image_fusion.ui.generation import FROM_IMAGES, NO_CROP
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.uploads import upload_options

pytestmark = pytest.mark.slow
PROMPT = "paint a red ball"
ARGS = dict(negative_prompt="blurry", num_inference_steps=3, seed=5, strength=0.7, padding_mask_crop=3)


@pytest.fixture(scope="module", autouse=True)
def small_areas() -> Iterator[None]:
    """Every pipeline this module loads (the CLI's too) at the small image areas, in one torch thread: the
    VAE and vision areas, and the output size an image suggests (the same area, as in diffusers' Edit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("qwen_image_fusion.models.qwen_image_edit.model.VAE_AREA", SMALL_VAE_AREA)
        patch.setattr("qwen_image_fusion.models.qwen_image_edit.model.CONDITION_AREA", SMALL_CONDITION_AREA)
        patch.setattr("qwen_image_fusion.models.qwen_image_edit.config.VAE_AREA", SMALL_VAE_AREA)
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_edit_checkpoints(tmp_path_factory.mktemp("inpaint-front"), {"edit": 7, "plus-2509": 8})


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inpaint-files")
    paths = {name: root / f"{name}.png" for name in ("image", "mask", "small_mask")}
    drawn_image(75, 53, 1).save(paths["image"])
    ellipse_mask(75, 53).save(paths["mask"])
    ellipse_mask(40, 30).save(paths["small_mask"])
    return paths


@pytest.fixture(scope="module")
def pipe(checkpoints) -> Any:
    return our_edit_pipeline(checkpoints["edit"])


@pytest.fixture(scope="module")
def expected(pipe, files) -> str:
    """The Python API's PNG digest of the request every front door sends."""
    image, mask = (PIL.Image.open(files[name]) for name in ("image", "mask"))
    [result] = pipe.generate(PROMPT, image=image, mask_image=mask, **ARGS)
    assert result.size == pipe.model.default_size([image])
    return png_sha256(result)


def edit_command(checkpoint: Path, files: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "edit", PROMPT, "--image", str(files["image"]), "--model", str(checkpoint), "--variant", "reference",
        "--dtype", "fp32", "--negative-prompt", "blurry", "--steps", "3", "--seed", "5", "-o", str(out),
        *extra,
    ]  # fmt: skip


def test_cli_writes_the_python_api_bytes(checkpoints, files, expected, tmp_path) -> None:
    out = tmp_path / "out.png"
    extra = ["--mask", str(files["mask"]), "--strength", "0.7", "--padding-mask-crop", "3"]
    assert main(edit_command(checkpoints["edit"], files, out, *extra)) == 0
    assert png_sha256(PIL.Image.open(out)) == expected


@pytest.mark.parametrize(
    ("checkpoint", "extra", "message"),
    [
        ("edit", ["--mask", "small_mask"], "mask_image is 40x30 but the input image is 75x53"),
        ("edit", ["--padding-mask-crop", "4"], "padding_mask_crop needs mask_image"),
        ("edit", ["--strength", "0.5"], "strength needs mask_image"),
        ("edit", ["--mask", "mask", "--width", "64"], "width and height: an inpainting edit is made at"),
        ("plus-2509", ["--mask", "mask"], "plus-2509 neither inpaints nor starts from an image"),
    ],
)
def test_cli_refuses_bad_inpainting_in_one_line_before_loading(
    checkpoints, files, tmp_path, monkeypatch, capsys, checkpoint, extra, message
) -> None:
    monkeypatch.setattr(
        "qwen_image_fusion.ui.commands.load", lambda *_args: pytest.fail("the model loaded before the checks")
    )
    extra = [str(files[a]) if a in files else a for a in extra]
    out = tmp_path / "out.png"
    assert main(edit_command(checkpoints[checkpoint], files, out, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_openai_client_sends_the_mask_and_extension_fields(pipe, files, expected) -> None:
    image, mask = (("x.png", files[name].read_bytes(), "image/png") for name in ("image", "mask"))
    with openai_client(pipe) as client:
        response = client.images.edit(image=image, mask=mask, prompt=PROMPT, extra_body=ARGS)
        got = PIL.Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
        assert png_sha256(got) == expected
        small = ("m.png", files["small_mask"].read_bytes(), "image/png")
        refusals = [
            (dict(mask=small), {}, "mask", "mask_image is 40x30 but the input image is 75x53"),
            ({}, {"padding_mask_crop": 3}, "padding_mask_crop", "padding_mask_crop needs mask_image"),
            (dict(mask=mask), {"size": "64x48"}, "size", "an inpainting edit is made at the size"),
        ]
        for files_, body, param, message in refusals:
            with pytest.raises(openai.BadRequestError) as caught:
                client.images.edit(image=image, prompt=PROMPT, extra_body=body, **files_)
            error = caught.value.body
            assert error["param"] == param and message in error["message"], error


FORM = dict(prompt=PROMPT, negative_prompt="blurry", size=FROM_IMAGES, width=64, height=64,
            num_inference_steps=3, true_cfg_scale=4.0, seed=5, randomize_seed=False,
            num_images=1)  # fmt: skip


def test_demo_edit_api_gives_the_python_api_bytes(pipe, files, expected) -> None:
    demo = build_app(pipe, Limits.for_device("cpu"))
    _, url, _ = demo.launch(
        server_name="127.0.0.1", prevent_thread_lock=True, quiet=True, **upload_options(True)
    )
    try:
        client = Client(url, verbose=False, analytics_enabled=False)
        images, seed, details = client.predict(
            **FORM, image_1=handle_file(files["image"]), mask=handle_file(files["mask"]), strength=0.7,
            padding_mask_crop=3, variant=pipe.variant, api_name="/edit",
        )  # fmt: skip
        assert [png_sha256(PIL.Image.open(i["image"])) for i in images] == [expected]
        assert seed == 5 and "128×96, 3 steps" in details  # from step int(3 - 0.7 * 3) = 0
        with pytest.raises(ValidationError, match="mask_image is 40x30 but the input image is 75x53"):
            client.predict(
                **FORM, image_1=handle_file(files["image"]), mask=handle_file(files["small_mask"]),
                strength=0.7, padding_mask_crop=NO_CROP, variant=pipe.variant, api_name="/edit",
            )  # fmt: skip
    finally:
        demo.close()
