"""A call's `lora_scales` act on that call only (diffusers' per-call `cross_attention_kwargs={"scale": ...}`);
`set_lora_scales` is the lasting way (diffusers' `set_adapters`). The Python API: a call with its own scale,
then a call without, gives the loaded scale's image. The HTTP server: two concurrent requests with
different scales each give the bytes of the same request served alone."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from helpers import png_sha256
from lora_files import block_modules, linear_shapes, random_factors, write_peft

from bench.in_thread import InThread
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.batching import BatchPlan
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.runner import Runner
from qwen_image_fusion.ui.server import build_server

REQUEST = dict(width=32, height=32, num_inference_steps=3, seed=7)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory):
    pipe = load_pipeline(variant="reference", device="cpu", dtype="fp32")
    transformer = pipe.transformer
    modules = block_modules(transformer.config.num_layers)
    factors = random_factors(linear_shapes(transformer), modules, 4, seed=3, std=0.3)
    path = write_peft(tmp_path_factory.mktemp("lora") / "style.safetensors", factors)
    assert pipe.load_lora(path, scale=0.5) == "style"
    return pipe


def image_hash(pipe, **values) -> str:
    return png_sha256(pipe.generate("a red circle", **REQUEST, **values)[0])


def test_a_calls_scale_lasts_for_that_call(pipe) -> None:
    loaded = image_hash(pipe)
    strong = image_hash(pipe, lora_scales={"style": 3.0})
    assert strong != loaded and "style x3 on" in pipe.last_run.loras  # what ran
    assert image_hash(pipe) == loaded  # the next call runs at the loaded scale again
    assert pipe.loras["style"].scale == 0.5 and "style x0.5 on" in pipe.last_run.loras
    pipe.set_lora_scales({"style": 3.0})  # the lasting way
    try:
        assert image_hash(pipe) == strong and pipe.loras["style"].scale == 3.0
        assert image_hash(pipe, lora_scales={"style": 0.5}) == loaded
        assert image_hash(pipe) == strong
    finally:
        pipe.set_lora_scales({"style": 0.5})


def test_concurrent_requests_with_different_scales_each_equal_the_request_served_alone(pipe) -> None:
    """The server loads its LoRAs at 0 and sets every one per request; requests that differ in scales
    never share a batch, and none leaves its scales to the next."""
    pipe.set_lora_scales({"style": 0.0})
    runner = Runner(pipe, Limits.for_device("cpu"), BatchPlan.for_device(torch.device("cpu"), 4, False))
    server = InThread(build_server(pipe, runner))
    scales = [0.8, -0.6, None, 0.8]

    def ask(scale: float | None) -> str:
        body = {"prompt": "a red circle", "size": "32x32", "seed": 7, "num_inference_steps": 3}
        if scale is not None:
            body["lora_scales"] = {"style": scale}
        response = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["b64_json"]

    try:
        with ThreadPoolExecutor(len(scales)) as pool:
            together = list(pool.map(ask, scales))
        alone = [ask(scale) for scale in scales]
    finally:
        server.close()
        runner.close()
        pipe.set_lora_scales({"style": 0.5})
    assert together == alone
    assert together[0] == together[3] != together[1] != together[2] != together[0]


def test_lasting_and_call_scales_are_checked(pipe, tmp_path: Path) -> None:
    from qwen_image_fusion.models.errors import InputError

    with pytest.raises(InputError, match="no LoRA named 'other' is loaded") as caught:
        pipe.generate("a red circle", **REQUEST, lora_scales={"other": 1.0})
    assert caught.value.field == "lora_scales"
    with pytest.raises(InputError, match="must be a finite number"):
        pipe.set_lora_scales({"style": float("nan")})
    assert pipe.loras["style"].scale == 0.5
