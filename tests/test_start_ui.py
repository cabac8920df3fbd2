"""The web demo's "Image to image" tab for a text-to-image model (the embedded default): its "/edit" API
with a start image, a mask and a strength gives the Python API's PNG bytes, a mask of another size is refused
before the job queues, and Debian chromium inpaints an uploaded image through the page."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import ValidationError
from helpers import CHROMIUM, png_sha256
from PIL import Image
from test_img2img_oracle import ellipse_mask, photo
from test_ui_served import CHROMIUM_ARGS, _screenshot

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.uploads import upload_options

pytestmark = pytest.mark.slow
FORM = dict(prompt="a red circle", negative_prompt="blurry", size="custom", width=64, height=48,
            num_inference_steps=4, true_cfg_scale=4.0, seed=5, randomize_seed=False,
            num_images=1)  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("start")
    paths = {name: root / f"{name}.png" for name in ("image", "mask", "small_mask")}
    photo(71, 53).save(paths["image"])
    ellipse_mask(71, 53).save(paths["mask"])
    ellipse_mask(40, 30).save(paths["small_mask"])
    return paths


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any]]:
    pipe = load_pipeline(variant="reference", device="cpu", dtype="fp32")
    demo = build_app(pipe, Limits.for_device("cpu"))
    _, url, _ = demo.launch(
        server_name="127.0.0.1", prevent_thread_lock=True, quiet=True, **upload_options(True)
    )
    try:
        yield url, pipe
    finally:
        demo.close()


def test_image_to_image_api_gives_the_python_api_bytes(server, files) -> None:
    url, pipe = server
    client = Client(url, verbose=False, analytics_enabled=False)
    images, seed, details = client.predict(
        **FORM, image_1=handle_file(files["image"]), mask=handle_file(files["mask"]), strength=0.75,
        variant=pipe.variant, api_name="/edit",
    )  # fmt: skip
    expected = pipe.generate(
        "a red circle", negative_prompt="blurry", width=64, height=48, num_inference_steps=4, seed=5,
        init_image=Image.open(files["image"]), mask_image=Image.open(files["mask"]), strength=0.75,
    )  # fmt: skip
    assert [png_sha256(Image.open(i["image"])) for i in images] == [png_sha256(e) for e in expected]
    assert seed == 5 and "3 steps" in details  # 0.75 of 4 steps run
    with pytest.raises(ValidationError, match="mask_image is 40x30 but init_image is 71x53"):
        client.predict(
            **FORM, image_1=handle_file(files["image"]), mask=handle_file(files["small_mask"]), strength=0.75,
            variant=pipe.variant, api_name="/edit",
        )  # fmt: skip


@pytest.mark.browser
def test_page_inpaints_an_uploaded_image(server, files, tmp_path) -> None:
    from playwright import sync_api

    url, _ = server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        page.goto(url)
        expect = sync_api.expect
        page.get_by_role("tab", name="Image to image").click()
        page.locator("#edit_image_1 input[type=file]").set_input_files(str(files["image"]))
        page.locator("#edit_mask input[type=file]").set_input_files(str(files["mask"]))
        page.locator("#edit_prompt textarea").fill("a red circle")
        for field, value in (("width input", 64), ("height input", 48), ("steps input[type=number]", 4)):
            box = page.locator(f"#edit_{field}")
            box.fill(str(value))
            box.blur()
        strength = page.locator("#edit_strength input[type=number]")
        strength.fill("0.5")
        strength.blur()
        page.locator("#edit").click()
        expect(page.locator("#edit_details")).to_contain_text("2 steps", timeout=120_000)  # half of 4
        image = page.locator("#edit_details").locator("xpath=../..").locator("img").first
        expect(image).to_be_visible()
        _screenshot(page, tmp_path / "ui_inpainted.png")
        browser.close()
