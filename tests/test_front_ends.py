"""Every front end turns the same raw inputs into the same request: `qwen-image generate`'s flags, the web
demo's /generate API (through gradio_client) and the HTTP server's JSON each reach `Pipeline.run` with an
equal `GenerationRequest` (pipelines/generation_request.py resolves them all), and `generate()` with the
same arguments makes the same one."""

from dataclasses import replace
from typing import Any

import httpx
import pytest
from gradio_client import Client

from bench.in_thread import InThread
from qwen_image_fusion.models.cache_presets import CACHE_PRESETS
from qwen_image_fusion.pipelines import load_pipeline, pipeline
from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.cli import main
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.runner import Runner
from qwen_image_fusion.ui.server import build_server

PROMPT, NEGATIVE = "a red circle on the left", "blurry"
VALUES = {"width": 48, "height": 32, "num_inference_steps": 3, "true_cfg_scale": 3.5, "seed": 5}


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every request `Pipeline.run` receives, in order (the runs go on as usual)."""
    seen: list[Any] = []
    run = pipeline.Pipeline.run

    def recorded(self: Any, requests: list[Any], *args: Any, **kwargs: Any) -> Any:
        seen.extend(requests)
        return run(self, requests, *args, **kwargs)

    monkeypatch.setattr(pipeline.Pipeline, "run", recorded)
    return seen


@pytest.mark.slow
def test_cli_page_and_api_build_the_same_request(runs: list[Any], tmp_path: Any) -> None:
    v = VALUES
    flags = ["--width", "48", "--height", "32", "--steps", "3", "--true-cfg-scale", "3.5", "--seed", "5"]
    cli = [
        "generate",
        PROMPT,
        "--negative-prompt",
        NEGATIVE,
        "--num-images",
        "2",
        "--cache",
        "fast",
        "--fast-decode",
        *flags,
    ]
    assert main([*cli, "--device", "cpu", "--dtype", "fp32", "-o", str(tmp_path / "cli.png")]) == 0
    pipe = load_pipeline(device="cpu", dtype="fp32")
    runner = Runner(pipe, Limits.for_device("cpu"))
    demo = build_app(pipe, Limits.for_device("cpu"), runner)
    _, url, _ = demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    server = InThread(build_server(pipe, runner))
    try:
        page = {"negative_prompt": NEGATIVE, "aspect": "custom", "randomize_seed": False, "num_images": 2}
        page |= {"width": v["width"], "height": v["height"], "variant": pipe.variant}
        page |= {"num_inference_steps": v["num_inference_steps"], "true_cfg_scale": v["true_cfg_scale"]}
        Client(url, verbose=False, analytics_enabled=False).predict(
            PROMPT, **page, seed=v["seed"], api_name="/generate"
        )
        body = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "n": 2, "size": "48x32", "seed": v["seed"]}
        body |= {"num_inference_steps": 3, "true_cfg_scale": 3.5, "cache": "fast", "fast_decode": True}
        answer = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
        assert answer.status_code == 200
        ran = answer.json()["run"]  # what ran, as the stages recorded it
        assert (
            ran["decode"] == {"fast": True, "tiled": False, "fallback": ""}
            and ran["cache"]["preset"] == "fast"
        )
        assert ran["cache"]["cfg"] and len(ran["cache"]["skipped"]["positive"]) == 2  # one count per image
    finally:
        server.close()
        demo.close()
        runner.close()
    pipe.generate(
        PROMPT, negative_prompt=NEGATIVE, num_images_per_prompt=2, cache="fast", fast_decode=True, **v
    )
    assert len(runs) == 4
    cli_request = runs[0]
    assert cli_request.prompts == (PROMPT,) and cli_request.negative_prompts == (NEGATIVE,)
    assert (cli_request.width, cli_request.num_images_per_prompt, cli_request.true_cfg) == (48, 2, True)
    assert cli_request.cache is CACHE_PRESETS["fast"] and cli_request.fast_decode
    page_request = replace(cli_request, cache=None, fast_decode=False)
    assert runs[1] == page_request, "the page (its step cache is a session setting; no fast decode)"
    assert runs[2] == cli_request, "the HTTP API"
    assert runs[3] == cli_request, "generate()"
