"""The real app (embedded default model) served on 127.0.0.1: ui/README.md's gradio_client call, and
Debian chromium driving the page through Playwright (generate, errors, the cost cap, Stop, a closed tab).
"""

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gradio_client import Client
from gradio_client.exceptions import ValidationError
from helpers import CHROMIUM
from PIL import Image

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.app import EMBEDDED_EXAMPLES, build_app
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.runner import Runner

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
SIZE = 64  # tiny sizes and few steps keep the whole file well under a minute on 2 CPU cores


# Every test here uses the module's server, which loads the embedded default with the CPU's default dtype
# (the README's client call shows the defaults), whichever test builds it first.
pytestmark = pytest.mark.cpu_dtype


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[int], Runner]]:
    """URL of the served app (the CPU's default limits), the step counts of the generations that ran to
    the end, and its runner."""
    pipe = load_pipeline()
    completed: list[int] = []
    generate = pipe.generate

    def recording_generate(*args: Any, **kwargs: Any) -> list[Image.Image]:
        images = generate(*args, **kwargs)
        completed.append(pipe.last_run.num_inference_steps)
        return images

    pipe.generate = recording_generate  # type: ignore[method-assign]
    limits = Limits.for_device("cpu")
    runner = Runner(pipe, limits)
    demo = build_app(pipe, limits, runner)
    _, url, _ = demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        yield url, completed, runner
    finally:
        demo.close()


def test_readme_client_call(server: tuple[str, list[int], Runner]) -> None:
    client = Client(server[0], verbose=False, analytics_enabled=False)
    images, seed, details = client.predict(
        prompt="A red apple on a wooden table, soft window light",
        negative_prompt="blurry",
        aspect="custom",
        width=SIZE,
        height=SIZE // 2,
        num_inference_steps=2,
        true_cfg_scale=4.0,
        seed=42,
        randomize_seed=False,
        num_images=2,
        variant="reference",
        api_name="/generate",
    )
    assert [Image.open(i["image"]).size for i in images] == [(SIZE, SIZE // 2)] * 2
    assert seed == 42
    assert all(part in details for part in ("`42`", "2 steps", "`reference`", "decoding"))
    with pytest.raises(ValidationError, match="must be a multiple of 16"):
        client.predict("x", aspect="custom", width=SIZE + 1, height=SIZE, api_name="/generate")


@pytest.mark.browser
def test_page_generates_shows_errors_and_stops(server: tuple[str, list[int], Runner], tmp_path: Path) -> None:
    from playwright import sync_api  # conftest checked that it and chromium are installed

    url, completed, _ = server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        outside: list[str] = []
        page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
        page.goto(url)
        expect = sync_api.expect

        # The embedded default says what it is, its plan, and offers scenes it can draw as examples.
        expect(page.get_by_text("trained on drawn scenes", exact=False)).to_be_visible()
        expect(page.get_by_text("on cpu, one process", exact=False)).to_be_visible()
        expect(page.get_by_text(EMBEDDED_EXAMPLES[0], exact=True).first).to_be_visible()

        # A preset fills the size fields; typing a size switches back to "custom".
        page.get_by_text("16:9 · 1664×928").click()
        expect(page.locator("#width input")).to_have_value("1664")
        expect(page.locator("#height input")).to_have_value("928")
        _fill(page, width=SIZE, height=SIZE)
        expect(page.locator("#generate_form").get_by_role("radio", name="custom")).to_be_checked()

        # A generation: the image appears and the details show the seed that was used.
        _fill(page, prompt="A red apple on a wooden table", steps=4)
        page.locator("#generate").click()
        expect(page.locator("#details")).to_contain_text("4 steps", timeout=60_000)
        image = page.locator("#gallery img").first
        expect(image).to_be_visible()
        assert image.evaluate("img => [img.naturalWidth, img.naturalHeight]") == [SIZE, SIZE]
        expect(page.locator("#details")).to_contain_text(re.compile(r"Seed: \d+"))
        assert page.locator("#seed input").input_value() == "-1"  # -1: the next run draws a new seed
        _screenshot(page, tmp_path / "ui_generated.png")

        # Bad input shows the pipeline's message, and the page keeps working.
        _fill(page, prompt="")
        page.locator("#generate").click()
        expect(page.get_by_text("prompt is empty")).to_be_visible(timeout=30_000)
        _fill(page, prompt="A foggy lake", width=SIZE + 2)
        page.locator("#generate").click()
        expect(page.get_by_text(f"width {SIZE + 2} must be a multiple of 16")).to_be_visible(timeout=30_000)
        _screenshot(page, tmp_path / "ui_error.png")

        # A request over the cost cap is refused at the prompt, saying the limit (1:1 at 20 steps is 35).
        page.get_by_text("1:1 · 1328×1328").click()
        _fill(page, steps=20)
        page.locator("#generate").click()
        expect(page.get_by_text("this server allows at most 32 per request")).to_be_visible(timeout=30_000)

        # Stop ends a long run (200 steps at 256x256: about a minute) and says where: the previous run's
        # details are gone, nothing shows "Error"; the next request then completes.
        _fill(page, width=256, height=256, steps=200)
        page.locator("#generate").click()
        progress = page.get_by_role("progressbar", name="Denoising")
        expect(progress).to_be_visible(timeout=30_000)
        page.locator("#stop").click()
        expect(page.locator("#details")).to_have_text(re.compile(r"^\s*Stopped after \d+ of 200 steps\.\s*$"))
        expect(progress).to_be_hidden()
        expect(page.get_by_text("Error", exact=True)).to_have_count(0)
        _screenshot(page, tmp_path / "ui_stopped.png")
        _fill(page, width=SIZE, height=SIZE, steps=3)
        page.locator("#generate").click()
        expect(page.locator("#details")).to_contain_text("3 steps", timeout=60_000)
        assert 200 not in completed

        # The step cache, chosen in its panel, runs and says how many steps it skipped.
        page.locator("#generate_form").get_by_text("Preset, step cache and LoRA").click()
        page.locator("#cache input").click()
        page.get_by_role("option", name=re.compile(r"^fast: ")).click()
        _fill(page, steps=6)
        page.locator("#generate").click()
        skipped = "Step cache: fast: middle blocks skipped in"
        expect(page.locator("#details")).to_contain_text(skipped, timeout=60_000)
        # The fast decode, ticked in the same panel, runs and says so.
        page.locator("#fast_decode input").check()
        page.locator("#generate").click()
        expect(page.locator("#details")).to_contain_text("Decode: the VAE's 2D form", timeout=60_000)
        browser.close()
    assert outside == []  # the page loads nothing from outside 127.0.0.1


@pytest.mark.browser
def test_closing_the_tab_stops_its_generation(server: tuple[str, list[int], Runner]) -> None:
    from playwright import sync_api

    url, completed, runner = server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.goto(url)
        _fill(page, prompt="A lighthouse in a storm", width=256, height=256, steps=199)
        page.locator("#generate").click()
        sync_api.expect(page.get_by_role("progressbar", name="Denoising")).to_be_visible(timeout=30_000)
        page.close()
        closed = time.monotonic()
        while runner.jobs():
            assert time.monotonic() - closed < 2.0, "the generation kept running after its tab closed"
            time.sleep(0.02)
        browser.close()
    assert 199 not in completed


def _fill(page: Any, **fields: str | int) -> None:
    """Type into the page's fields (prompt, width, height, steps) by their element ids."""
    selectors = {
        "prompt": "#prompt textarea",
        "width": "#width input",
        "height": "#height input",
        "steps": "#steps input[type=number]",
    }
    for name, value in fields.items():
        box = page.locator(selectors[name])
        box.fill(str(value))
        box.blur()


def _screenshot(page: Any, path: Path) -> None:
    """Full-page PNG under pytest's tmp dir, copied to $QWEN_IMAGE_ARTIFACTS when set."""
    page.screenshot(path=str(path), full_page=True)
    if artifacts := os.environ.get("QWEN_IMAGE_ARTIFACTS"):
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, artifacts)
