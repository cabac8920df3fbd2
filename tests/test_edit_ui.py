"""The web demo's Edit tab on a real tiny Edit-2511-like checkpoint (the tests' small image areas), served on
127.0.0.1 with the demo's own upload options: the "/edit" API gives the Python API's PNG bytes; bad requests
are refused before they queue (no image, a file the server never received, not an image); uploads are
bounded per input kind (images up to the byte and pixel caps; anything else, and every upload to a
text-to-image page, at most 1 kB); and Debian chromium edits an image through the page."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from edit_fixtures import build_edit_checkpoint, drawn_image, our_edit_pipeline
from gradio_client import Client, handle_file
from gradio_client.exceptions import ValidationError
from helpers import CHROMIUM, png_sha256
from PIL import Image
from test_ui_app import FakePipe
from test_ui_served import CHROMIUM_ARGS, _screenshot

from qwen_image_fusion.pipelines.images import MAX_INPUT_BYTES
from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.generation import FieldError, job_from_edit_inputs
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.uploads import upload_caps, upload_options

pytestmark = pytest.mark.slow
LIMITS = Limits.for_device("cpu")
EDIT = dict(prompt="put 1 beside 2", negative_prompt=" ", size="custom", width=48, height=32,
            num_inference_steps=2, true_cfg_scale=4.0, seed=5, randomize_seed=False,
            num_images=1)  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("uploads")
    paths = {name: root / f"{name}.png" for name in ("a", "b", "big", "huge")}
    drawn_image(75, 53, 1).save(paths["a"])
    drawn_image(50, 70, 2, "P").save(paths["b"])
    drawn_image(800, 800, 3).save(paths["big"])  # noise: about 1.9 MB, past the guard's 1 MB spool
    Image.new("RGB", (5000, 4000), (10, 20, 30)).save(paths["huge"])  # 20 MP in a few kB
    paths["text"] = root / "notes.txt"
    paths["text"].write_text("x" * 2048)
    paths["small_text"] = root / "small.png"  # under 1 kB: the upload route takes it; the edit does not
    paths["small_text"].write_text("not an image")
    return paths


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    checkpoint = build_edit_checkpoint(
        tmp_path_factory.mktemp("edit-ui") / "plus", "QwenImageEditPlusPipeline", True
    )
    pipe = our_edit_pipeline(checkpoint, dtype=None, variant="auto")
    demo = build_app(pipe, LIMITS)
    _, url, _ = demo.launch(
        server_name="127.0.0.1", prevent_thread_lock=True, quiet=True, **upload_options(True)
    )
    try:
        yield url, pipe
    finally:
        demo.close()


@pytest.mark.cpu_dtype
def test_edit_api_gives_the_python_api_bytes(server, files) -> None:
    url, pipe = server
    client = Client(url, verbose=False, analytics_enabled=False)
    images, seed, details = client.predict(
        **EDIT, image_1=handle_file(files["a"]), image_2=handle_file(files["b"]), image_3=None,
        variant=pipe.variant, api_name="/edit",
    )  # fmt: skip
    expected = pipe.generate(
        "put 1 beside 2", image=[Image.open(files["a"]), Image.open(files["b"])], negative_prompt=" ",
        width=48, height=32, num_inference_steps=2, true_cfg_scale=4.0, seed=5,
    )  # fmt: skip
    assert [png_sha256(Image.open(i["image"])) for i in images] == [png_sha256(e) for e in expected]
    assert seed == 5 and "image encoding" in details and "48×32" in details
    # without a size the images give it: the last one's 50:70 (Plus) at 1024x1024 pixels, sides rounded to
    # multiples of 32: sqrt(1024^2 * 50 / 70) = 865.4 -> 864, 865.4 * 70 / 50 = 1211.6 -> 1216
    assert pipe.default_size([Image.open(files["a"]), Image.open(files["b"])]) == (864, 1216)


def test_bad_edit_requests_are_refused_before_they_queue(server, files) -> None:
    url, pipe = server
    client = Client(url, verbose=False, analytics_enabled=False)
    call = {**EDIT, "variant": pipe.variant, "api_name": "/edit"}
    with pytest.raises(ValidationError, match="give an input image to edit"):
        client.predict(**call, image_1=None, image_2=None, image_3=None)
    with pytest.raises(ValidationError, match="size 'xyz' must be 'from the images' or 'custom'"):
        client.predict(**{**call, "size": "xyz"}, image_1=handle_file(files["a"]), image_2=None, image_3=None)
    with pytest.raises(ValidationError, match="image_2 is not an image Pillow can read"):
        client.predict(**call, image_1=handle_file(files["a"]), image_2=handle_file(files["small_text"]),
                       image_3=None)  # fmt: skip
    # a file this server never received (a raw API call naming a path on the server) is refused
    info = httpx.get(f"{url}gradio_api/info", timeout=30).json()["named_endpoints"]["/edit"]["parameters"]
    raw = {
        **EDIT,
        "variant": pipe.variant,
        "image_1": {"path": str(files["a"]), "meta": {"_type": "gradio.FileData"}},
    }
    values = [raw.get(parameter["parameter_name"]) for parameter in info]
    refused = httpx.post(f"{url}gradio_api/call/edit", json={"data": values}, timeout=30)
    assert refused.status_code == 400 and "was not uploaded by a user" in refused.text  # Gradio's own check
    # and ours, beneath it: the request's check takes only files the upload route received
    job = {**raw, "image_2": None, "image_3": None}
    with pytest.raises(FieldError, match="image_1 must be an image uploaded to this server"):
        job_from_edit_inputs("s", job, pipe, uploaded=set())


def upload(url: str, path: Path) -> httpx.Response:
    with path.open("rb") as handle:
        return httpx.post(f"{url}gradio_api/upload", files={"files": (path.name, handle)}, timeout=60)


def test_uploads_are_bounded_per_input_kind(server, files, tmp_path) -> None:
    url, _ = server
    taken = upload(url, files["big"])  # an image for the Edit tab, replayed from the guard's spool file
    assert taken.status_code == 200
    assert Path(taken.json()[0]).read_bytes() == files["big"].read_bytes()
    for name, problem in (("text", "notes.txt: not an image"), ("huge", "huge.png: 5000x4000 pixels")):
        refused = upload(url, files[name])
        assert refused.status_code == 413 and refused.text == f"{problem}; this server takes {upload_caps()}"
    too_big = tmp_path / "too_big.png"
    too_big.write_bytes(b"\0" * (MAX_INPUT_BYTES + 1))
    refused = upload(url, too_big)
    assert refused.status_code == 413


def test_a_text_to_image_page_still_takes_no_uploads(files) -> None:
    demo = build_app(FakePipe(), LIMITS)
    _, url, _ = demo.launch(
        server_name="127.0.0.1", prevent_thread_lock=True, quiet=True, **upload_options(False)
    )
    try:
        assert upload(url, files["big"]).status_code == 413  # Gradio's 1 kB cap: the page takes no files
        config = httpx.get(f"{url}config", timeout=30).json()
        assert "edit" not in json.dumps([d.get("api_name") for d in config["dependencies"]])
    finally:
        demo.close()


@pytest.mark.browser
def test_page_edits_an_uploaded_image(server, files, tmp_path) -> None:
    from playwright import sync_api

    url, _ = server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        page.goto(url)
        expect = sync_api.expect
        expect(page.get_by_text(upload_caps(), exact=False)).to_be_visible()
        expect(page.locator("#prompt")).to_be_hidden()  # the text-to-image form: this model only edits
        page.locator("#edit_image_1 input[type=file]").set_input_files(str(files["a"]))
        page.locator("#edit_prompt textarea").fill("make the sky red")
        for field, value in (("width input", 48), ("height input", 32), ("steps input[type=number]", 2)):
            box = page.locator(f"#edit_{field}")
            box.fill(str(value))
            box.blur()
        expect(page.get_by_role("radio", name="custom")).to_be_checked()
        page.locator("#edit").click()
        expect(page.locator("#edit_details")).to_contain_text("image encoding", timeout=120_000)
        image = page.locator("#edit_details").locator("xpath=../..").locator("img").first
        expect(image).to_be_visible()
        _screenshot(page, tmp_path / "ui_edited.png")
        browser.close()
