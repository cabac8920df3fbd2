"""The HTTP server (ui/server.py) through the official `openai` client and raw HTTP: generations and edits,
every error path, API keys, the queue bound, a client that disconnects, the time limit, 40 concurrent
clients with batching, a 200-request soak, and the web demo on the same port.

The embedded default serves at tiny sizes (FP32, one torch thread: about 0.1 s a request on 2 busy cores);
a fake pipeline that takes input images stands in for an Edit model and controls timing.
"""

import base64
import gc
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
from helpers import rss_bytes, wait_for
from PIL import Image
from test_img2img_oracle import ellipse_mask, photo

from bench.in_thread import InThread
from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import CheckpointSpec, GenerationDefaults
from qwen_image_fusion.pipelines import RunInfo, load_pipeline
from qwen_image_fusion.pipelines.generation_request import resolve_request
from qwen_image_fusion.pipelines.run_info import Generated
from qwen_image_fusion.ui.access import ApiKeys, read_api_keys
from qwen_image_fusion.ui.image_cache import Encoding, image_bytes
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.runner import Runner
from qwen_image_fusion.ui.server import build_server

KEY = "test-key-0123456789abcdef"
PROMPTS = [f"a red circle on the left and a blue square on the right, request {i:02d}" for i in range(40)]
NO_CFG = {"num_inference_steps": 2, "true_cfg_scale": 1.0}
TINY = {"size": "16x16", "extra_body": NO_CFG}  # one latent token, one transformer call a step


class FakePipe:
    """The pipeline surface the server uses, for a model that takes up to 3 input images; each step sleeps
    `delay` s (or waits for `hold` to be set) and the images it returns are coloured by seed. Requests are
    resolved by the real `resolve_request`; each run's request lands in `calls` as a dict."""

    model_name = "/models/Fake-Edit"
    device = torch.device("cpu")
    size_multiple = 16
    defaults = GenerationDefaults(width=64, height=32, num_inference_steps=3, true_cfg_scale=4.0)
    spec = CheckpointSpec(
        family=SimpleNamespace(name="fake-edit"), directory=Path(model_name), name=model_name,
        attention_heads=24, size_multiple=16, defaults=defaults, weights=WeightFormat.BF16, max_images=3,
    )  # fmt: skip
    model = SimpleNamespace(
        default_size=lambda images: (images[0].width // 16 * 16, images[0].height // 16 * 16)
    )

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.hold = threading.Event()
        self.hold.set()
        self.variant = "contract"
        self.loras: dict[str, Any] = {}
        self.calls: list[dict[str, Any]] = []
        self.steps_run = 0
        self.last_run: Any = None

    def fusion_summary(self) -> str:
        return "FP8 norm+quant fusion: off (BF16 weights)"

    def available_variants(self) -> list[str]:
        return ["reference", "contract"]

    def set_variant(self, variant: str) -> None:
        self.variant = variant

    def set_lora_scales(self, scales: dict[str, float]) -> None:
        self.scales = dict(scales)

    def parallel_summary(self) -> str:
        return "one process"

    def request(self, prompt: str, **values: Any) -> Any:
        return resolve_request(
            self.spec, prompt, suggest_size=self.model.default_size, loras=self.loras, **values
        )

    def run(self, requests: list[Any], slots: int | None = None, on_step: Any = None) -> list[Generated]:
        results = []
        for r in requests:
            if r.lora_scales:
                self.set_lora_scales(dict(r.lora_scales))
            self.calls.append(
                {
                    "prompt": r.prompts[0], "width": r.width, "height": r.height, "seed": r.seed,
                    "true_cfg_scale": r.true_cfg_scale, "num_images_per_prompt": r.num_images_per_prompt,
                    "image": list(r.images), "lora_scales": dict(r.lora_scales),
                }
            )  # fmt: skip
            for i in range(1, r.num_inference_steps + 1):
                self.hold.wait(30)
                time.sleep(self.delay)
                self.steps_run += 1
                on_step(i, r.num_inference_steps)
            timings = {"text_encoding": 0.01, "denoising": 0.02, "decoding": 0.03, "total": 0.06}
            info = RunInfo(r.seed, r.width, r.height, r.num_inference_steps, self.variant, "off", timings)
            image = Image.new("RGB", (r.width, r.height), (r.seed % 256, 10, 20))
            results.append(Generated([image] * r.num_images_per_prompt, info))
        self.last_run = results[-1].info
        return results


def _client(url: str, key: str = "unused", **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, **kwargs)


def _png(image_data: Any) -> bytes:
    return base64.b64decode(image_data.b64_json)


def _serve(pipe: Any, limits: Limits, **kwargs: Any) -> tuple[InThread, Runner]:
    runner = Runner(pipe, limits, kwargs.pop("batch", None))
    return InThread(build_server(pipe, runner, **kwargs)), runner


@pytest.fixture(scope="module")
def embedded() -> Iterator[Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_pipeline(dtype="fp32", variant="reference")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served(embedded: Any) -> Iterator[tuple[str, Runner]]:
    """The embedded default behind the API, each request alone (no batching), the CPU's default limits."""
    server, runner = _serve(embedded, Limits.for_device("cpu"))
    try:
        yield server.url, runner
    finally:
        server.close()
        runner.close()


def test_openai_client_generates_what_generate_makes(served: tuple[str, Runner], embedded: Any) -> None:
    url, _ = served
    extra = {"seed": 7, "num_inference_steps": 2, "negative_prompt": "blurry", "true_cfg_scale": 3.0}
    response = _client(url).images.generate(prompt=PROMPTS[0], size="48x32", n=2, extra_body=extra)
    alone = embedded.generate(
        PROMPTS[0], width=48, height=32, num_images_per_prompt=2, seed=7, num_inference_steps=2,
        negative_prompt="blurry", true_cfg_scale=3.0,
    )  # fmt: skip
    assert [_png(d) for d in response.data] == [image_bytes(image, Encoding()) for image in alone]
    assert response.model_extra["seed"] == 7 and response.model_extra["model"] == "embedded-default"
    assert response.size == "48x32" and abs(response.created - time.time()) < 60

    by_url = _client(url).images.generate(
        prompt=PROMPTS[0], response_format="url", size="48x32", n=2, extra_body=extra
    )
    assert [httpx.get(d.url).content for d in by_url.data] == [_png(d) for d in response.data]
    assert httpx.get(f"{url}/v1/images/files/not-a-name.png").status_code == 404


def test_defaults_follow_the_model_and_a_random_seed_is_reported(
    served: tuple[str, Runner], embedded: Any
) -> None:
    url, _ = served
    response = httpx.post(
        f"{url}/v1/images/generations",
        json={"prompt": PROMPTS[1], "size": "32x32", "num_inference_steps": 2},
        timeout=60,
    )
    body = response.json()
    seed = body["seed"]
    assert response.status_code == 200 and 0 <= seed < 2**31
    # the model's own negative prompt (" " for the embedded default) and CFG scale, as generate picks them
    alone = embedded.generate(PROMPTS[1], width=32, height=32, num_inference_steps=2, seed=seed)
    assert base64.b64decode(body["data"][0]["b64_json"]) == image_bytes(alone[0], Encoding())


def test_models_health_and_metrics(served: tuple[str, Runner]) -> None:
    url, _ = served
    assert [m.id for m in _client(url).models.list()] == ["embedded-default"]
    assert httpx.get(f"{url}/health").json() == {
        "status": "ok", "model": "embedded-default", "device": "cpu", "queue_depth": 0, "running": 0,
    }  # fmt: skip
    _client(url).images.generate(prompt=PROMPTS[2], **TINY)
    text = httpx.get(f"{url}/metrics").text
    samples = _samples(text)
    assert samples["qwen_image_queue_depth"] == "0"
    assert int(samples['qwen_image_jobs_total{outcome="ok"}']) >= 1
    for stage in ("text_encoding", "denoising", "decoding"):
        assert float(samples[f'qwen_image_stage_seconds_sum{{stage="{stage}"}}']) > 0
    assert int(samples['qwen_image_http_requests_total{route="/v1/images/generations",status="200"}']) >= 1
    assert "# TYPE qwen_image_gpu_memory_bytes gauge" in text  # no samples on a CPU


BAD = [
    (
        b'{"prompt": "x", "num_inference_steps": NaN}',
        "num_inference_steps",
        "must be a finite number, not nan",
    ),
    (b'{"prompt": "x", "true_cfg_scale": Infinity}', "true_cfg_scale", "must be a finite number, not inf"),
    (b'{"prompt": "x", "seed": -Infinity}', "seed", "must be a finite number, not -inf"),
    (b'{"prompt": "x", "n": 1e999}', "n", "must be a finite number, not inf"),
    (b'{"prompt": "x", "num_inference_steps": "20"}', "num_inference_steps", "must be a number, not '20'"),
    (b'{"prompt": "x", "n": true}', "n", "must be a number, not True"),
    (b'{"prompt": "x", "n": 2.5}', "n", "n 2.5 must be a whole number"),
    (b'{"prompt": "x", "n": 0}', "n", "n 0 must be between 1 and 10"),
    (b'{"prompt": "x", "n": 11}', "n", "n 11 must be between 1 and 10"),
    (b'{"prompt": "x", "seed": -1}', "seed", "seed -1 must be an integer"),
    (b'{"prompt": "x", "num_inference_steps": 1}', "num_inference_steps", "must be between 2 and 200"),
    (b'{"prompt": "x", "true_cfg_scale": -1}', "true_cfg_scale", "must be a finite number >= 0"),
    (b'{"prompt": "x", "size": "50x64"}', "size", "width 50 must be a multiple of 16"),
    (
        b'{"prompt": "x", "size": "64x4096"}',
        "size",
        "height 4096 must be a multiple of 16 between 16 and 2048",
    ),
    (b'{"prompt": "x", "size": "big"}', "size", "must be WIDTHxHEIGHT"),
    (b'{"prompt": "x", "size": 64}', "size", "must be WIDTHxHEIGHT"),
    (b'{"prompt": "   "}', "prompt", "prompt is empty"),
    (b'{"n": 1}', "prompt", "prompt is empty"),
    (b'{"prompt": ["a", "b"]}', "prompt", "prompt must be text, not list"),
    (b'{"prompt": "x", "negative_prompt": 3}', "negative_prompt", "negative_prompt must be text, not int"),
    (b'{"prompt": "x", "response_format": "jpeg"}', "response_format", "must be b64_json or url"),
    (b'{"prompt": "x", "output_format": "gif"}', "output_format", "'gif' must be png, jpeg or webp"),
    (b'{"prompt": "x", "output_format": 3}', "output_format", "output_format 3 must be png, jpeg or webp"),
    (
        b'{"prompt": "x", "output_compression": 50}',
        "output_compression",
        "output_compression applies to jpeg and webp only, not png",
    ),
    (
        b'{"prompt": "x", "output_format": "jpeg", "output_compression": 101}',
        "output_compression",
        "output_compression 101 must be between 0 and 100",
    ),
    (
        b'{"prompt": "x", "output_format": "webp", "output_compression": "high"}',
        "output_compression",
        "output_compression must be a number, not 'high'",
    ),
    (b'{"prompt": "x", "model": "dall-e-3"}', "model", "model 'dall-e-3' is not served here"),
    (
        b'{"prompt": "x", "preset": "turbo"}',
        "preset",
        "preset 'turbo' is not one of lightning-8, lightning-4, edit-lightning-8, edit-lightning-4",
    ),
    (b'{"prompt": "x", "lora_scales": {"style": 0.5}}', "lora_scales", "no LoRA named 'style' is loaded"),
    (b'{"prompt": "x", "cache": "fastest"}', "cache", "cache 'fastest' is not a step-cache preset"),
    (b'{"prompt": "x", "cache": 2}', "cache", "cache must be text, not 2"),
    (b'{"prompt": "x", "lora_scales": [1]}', "lora_scales", "must be an object"),
    (b'{"prompt": "x", "user": 5}', "user", "user must be text"),
    (b'{"prompt": "x", "negative-prompt": "y"}', "negative-prompt", "unknown parameter 'negative-prompt'"),
    (
        b'{"prompt": "x", "size": "1024x1024"}',
        "num_inference_steps",
        "this server allows at most 32 per request",
    ),
    (b'{"prompt": "x"', None, "the request body is not JSON"),
    (b'["x"]', None, "the request body must be a JSON object"),
]


def test_bad_requests_get_one_clear_400(
    served: tuple[str, Runner], capfd: pytest.CaptureFixture[str]
) -> None:
    """NaN, infinity, text where a number belongs, out-of-range values, unknown fields, a request over the
    work cap: each is a 400 in OpenAI's error shape naming the parameter; none reaches the queue and the
    server log shows no traceback."""
    url, runner = served
    jobs_before = dict(runner.counters.jobs)
    for body, param, message in BAD:
        response = httpx.post(
            f"{url}/v1/images/generations", content=body, headers={"content-type": "application/json"}
        )
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["type"]) == (
            400,
            param,
            "invalid_request_error",
        ), body
        assert message in error["message"], (body, error["message"])
    assert runner.counters.jobs == jobs_before
    with pytest.raises(openai.BadRequestError, match="width 40 must be a multiple of 16") as err:
        _client(url).images.generate(prompt="x", size="40x32")
    assert err.value.status_code == 400 and err.value.param == "size"
    out, errors = capfd.readouterr()
    assert "Traceback" not in out + errors


def test_routes_methods_and_body_bounds(served: tuple[str, Runner]) -> None:
    url, _ = served
    missing = httpx.get(f"{url}/v1/images/variations")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{url}/v1/images/generations").status_code == 405
    big = json.dumps({"prompt": "x" * (2 * 2**20)})
    announced = httpx.post(
        f"{url}/v1/images/generations", content=big, headers={"content-type": "application/json"}
    )
    assert announced.status_code == 413 and announced.json()["error"]["code"] == "too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    streamed = httpx.post(f"{url}/v1/images/generations", content=chunks())
    assert streamed.status_code == 413


def _png_of(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_openai_client_inpaints_what_generate_makes(served: tuple[str, Runner], embedded: Any) -> None:
    """A text-to-image model reworks the one image of an edit (img2img) where its mask says: OpenAI's rule
    for a mask with alpha (transparent: edited) or diffusers' for a grey one (white: repainted)."""
    url, _ = served
    picture = photo(71, 53)
    white = ellipse_mask(71, 53).point(lambda v: 255 if v >= 128 else 0)
    transparent = Image.new("RGBA", white.size, (0, 0, 0, 255))
    transparent.putalpha(white.point(lambda v: 255 - v))
    extra = {"seed": 3, "num_inference_steps": 4, "strength": 0.8, "negative_prompt": "blurry"}
    values = dict(prompt=PROMPTS[0], size="64x48", extra_body=extra)
    expected = embedded.generate(
        PROMPTS[0], width=64, height=48, seed=3, num_inference_steps=4, strength=0.8,
        negative_prompt="blurry", init_image=picture, mask_image=white,
    )  # fmt: skip
    for mask in (transparent, white):
        response = _client(url).images.edit(
            image=("in.png", _png_of(picture), "image/png"),
            mask=("m.png", _png_of(mask), "image/png"),
            **values,
        )
        assert _png(response.data[0]) == image_bytes(expected[0], Encoding())
    plain = _client(url).images.edit(image=("in.png", _png_of(picture), "image/png"), **values)
    assert _png(plain.data[0]) != _png(response.data[0])  # without the mask all of it changes
    files = [("image", ("in.png", _png_of(picture), "image/png"))]
    cases = [
        (files * 2, {}, "image", "2 input images, but embedded-default takes at most 1"),
        (files, {"strength": "2"}, "strength", "strength must be a number in (0, 1]"),
        ([*files, ("mask", ("m.png", _png_of(white.resize((70, 53))), "image/png"))], {}, "mask", "70x53"),
    ]
    for parts, data, param, message in cases:
        response = httpx.post(f"{url}/v1/images/edits", files=parts, data={"prompt": "x"} | data)
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, param) and message in error["message"], error


def test_a_model_that_neither_edits_nor_starts_from_images_answers_a_clear_400() -> None:
    pipe = FakePipe()
    pipe.spec = SimpleNamespace(**(vars(FakePipe.spec) | {"max_images": 0, "starts_from_image": False}))
    server, runner = _serve(pipe, Limits.for_device("cpu"))
    try:
        with pytest.raises(
            openai.BadRequestError, match=r"the loaded model \(Fake-Edit\) cannot edit"
        ) as err:
            _client(server.url).images.edit(image=("in.png", _upload((32, 32)), "image/png"), prompt="x")
    finally:
        server.close()
        runner.close()
    assert err.value.code == "model_cannot_edit"


@pytest.fixture()
def fake() -> Iterator[tuple[FakePipe, str, Runner]]:
    pipe = FakePipe()
    server, runner = _serve(pipe, Limits(max_work=100, time_limit_s=60, queue_size=2, max_upload_mb=0.5))
    try:
        yield pipe, server.url, runner
    finally:
        pipe.hold.set()
        server.close()
        runner.close()


def _upload(size: tuple[int, int], colour: str = "red", mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_edits_pass_every_image_to_the_pipeline(fake: tuple[FakePipe, str, Runner]) -> None:
    pipe, url, _ = fake
    files = [
        ("a.png", _upload((40, 24)), "image/png"),
        ("b.png", _upload((16, 16), "blue", "RGBA"), "image/png"),
    ]
    response = _client(url).images.edit(
        image=files,
        prompt="put them together",
        n=2,
        size="64x32",
        extra_body={"seed": 9, "true_cfg_scale": 2.5},
    )
    call = pipe.calls[-1]
    assert [(im.size, im.mode) for im in call["image"]] == [((40, 24), "RGB"), ((16, 16), "RGBA")]
    assert (call["seed"], call["true_cfg_scale"], call["num_images_per_prompt"]) == (9, 2.5, 2)
    assert len(response.data) == 2 and Image.open(io.BytesIO(_png(response.data[0]))).size == (64, 32)
    # size "auto" (or none): the size the model picks for its input images
    _client(url).images.edit(image=("a.png", _upload((48, 40)), "image/png"), prompt="again", size="auto")
    assert (pipe.calls[-1]["width"], pipe.calls[-1]["height"]) == (48, 32)


def test_edit_errors(fake: tuple[FakePipe, str, Runner]) -> None:
    pipe, url, _ = fake
    calls = len(pipe.calls)
    png = ("image", ("a.png", _upload((16, 16)), "image/png"))
    cases = [
        ([png], {"prompt": "x", "seed": "nan"}, "seed", "seed must be a finite number, not nan"),
        ([png], {"prompt": "x", "n": "two"}, "n", "n must be a number, not 'two'"),
        ([png], {"prompt": "x", "lora_scales": "{bad"}, "lora_scales", "JSON object"),
        (
            [("image", ("a.png", b"not an image", "image/png"))],
            {"prompt": "x"},
            "image",
            "image 1 is not an image",
        ),
        ([png] * 4, {"prompt": "x"}, "image", "4 input images, but Fake-Edit takes at most 3"),
        ([], {"prompt": "x"}, "image", "give one or more input images"),
        (
            [png, ("mask", ("m.png", _upload((16, 16)), "image/png"))],
            {"prompt": "x"},
            "mask",
            "mask is not supported by Fake-Edit: it edits whole images",
        ),
        ([png], {"prompt": ""}, "prompt", "prompt is empty"),
    ]
    for files, data, param, message in cases:
        response = httpx.post(f"{url}/v1/images/edits", files=files or None, data=data)
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, param), (data, error)
        assert message in error["message"]
    too_big = httpx.post(
        f"{url}/v1/images/edits", files=[("image", ("a.png", os.urandom(600_000), "image/png"))]
    )
    assert too_big.status_code == 413
    assert len(pipe.calls) == calls


def test_each_request_sets_its_own_model_state(fake: tuple[FakePipe, str, Runner]) -> None:
    """The API's variant is the one the server started with, whatever another front door switched to, and
    every loaded LoRA the request does not name runs at 0: no earlier request's state reaches a request."""
    pipe, url, _ = fake
    pipe.loras = {"style": object(), "detail": object()}
    pipe.set_variant("reference")  # as a demo request for another variant leaves it
    _client(url).images.generate(prompt="styled", extra_body={"lora_scales": {"style": 0.5}})
    assert pipe.calls[-1]["lora_scales"] == pipe.scales == {"style": 0.5, "detail": 0.0}
    assert pipe.variant == "contract"
    _client(url).images.generate(prompt="plain")
    assert pipe.calls[-1]["lora_scales"] == pipe.scales == {"style": 0.0, "detail": 0.0}


def test_api_keys() -> None:
    pipe = FakePipe()
    server, runner = _serve(
        pipe, Limits(max_work=100, time_limit_s=60), keys=ApiKeys([KEY, "another-key-ABCDEFGHIJ"])
    )
    try:
        url = server.url
        assert httpx.get(f"{url}/health").status_code == 200  # for load balancers
        for path in ("/v1/models", "/metrics"):
            missing = httpx.get(f"{url}{path}")
            assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            _client(url, "wrong-key-0123456789").images.generate(prompt="x")
        basic = httpx.get(f"{url}/v1/models", headers={"authorization": f"Basic {KEY}"})
        assert basic.status_code == 401
        assert len(_client(url, KEY).images.generate(prompt="x").data) == 1
        assert httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert pipe.calls and len(pipe.calls) == 1  # refused requests never ran
    finally:
        server.close()
        runner.close()


def test_key_file_and_compare(tmp_path: Any) -> None:
    keys = ApiKeys([KEY])
    assert (
        keys.matches(KEY) and not keys.matches(KEY[:-1]) and not keys.matches("") and not keys.matches(None)
    )
    assert keys.authorize(f"Bearer {KEY}") and keys.authorize(f"bearer  {KEY}") and not keys.authorize(KEY)
    path = tmp_path / "keys.txt"
    path.write_text(f"# team keys\n\n{KEY}\n  another-key-ABCDEFGHIJ  \n")
    assert read_api_keys(path) == [KEY, "another-key-ABCDEFGHIJ"]
    for text, message in [
        ("short\n", "line 1: an API key is one word of at least 16"),
        ("# none\n", "has no key"),
    ]:
        path.write_text(text)
        with pytest.raises(InputError, match=message):
            read_api_keys(path)
    with pytest.raises(InputError, match="cannot read API key file"):
        read_api_keys(tmp_path / "missing.txt")


def test_full_queue_answers_429_with_retry_after(fake: tuple[FakePipe, str, Runner]) -> None:
    pipe, url, runner = fake
    pipe.hold.clear()  # the first request runs and waits; two more fill the queue of 2
    with ThreadPoolExecutor(3) as pool:
        pending = [pool.submit(_client(url).images.generate, prompt=f"p{i}") for i in range(3)]
        wait_for(lambda: runner.queue_depth() == 2 and len(runner.jobs()) == 3)
        refused = httpx.post(f"{url}/v1/images/generations", json={"prompt": "one too many"})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError, match="the queue is full"):
            _client(url).images.generate(prompt="and another")
        pipe.hold.set()
        assert all(len(p.result(30).data) == 1 for p in pending)
    assert runner.counters.jobs["queue_full"] == 2


def test_a_client_that_disconnects_stops_its_job_within_a_step(fake: tuple[FakePipe, str, Runner]) -> None:
    pipe, url, runner = fake
    pipe.delay = 0.05
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{url}/v1/images/generations", json={"prompt": "gone", "num_inference_steps": 200}, timeout=0.5
        )
    gone = time.monotonic()
    wait_for(lambda: not runner.jobs(), 2.0)
    steps = pipe.steps_run
    assert time.monotonic() - gone < 0.5 and steps < 30
    time.sleep(0.2)
    assert pipe.steps_run <= steps + 1  # the running step ends, nothing after it
    assert runner.counters.jobs["stopped"] == 1
    assert len(_client(url).images.generate(prompt="next").data) == 1


def test_the_time_limit_stops_a_request_with_a_400() -> None:
    pipe = FakePipe(delay=0.05)
    server, runner = _serve(pipe, Limits(max_work=100, time_limit_s=0.2))
    try:
        with pytest.raises(
            openai.BadRequestError,
            match=r"Stopped after \d of 200 steps: this server stops a request after 0.2 s",
        ):
            _client(server.url).images.generate(prompt="slow", extra_body={"num_inference_steps": 200})
    finally:
        server.close()
        runner.close()


def test_forty_clients_with_batching_get_the_bytes_of_requests_served_alone(embedded: Any) -> None:
    """40 openai clients at once against a server that batches up to 4 requests: all are answered, batches
    formed, and each response is byte-identical to the same request sent alone afterwards."""
    from qwen_image_fusion.pipelines.batching import BatchPlan

    server, runner = _serve(embedded, Limits.for_device("cpu"), batch=BatchPlan(4))
    try:
        client = _client(server.url, timeout=120)

        def ask(i: int) -> list[bytes]:
            extra = {"seed": i, "num_inference_steps": 2}
            return [
                _png(d)
                for d in client.images.generate(prompt=PROMPTS[i], size="32x32", extra_body=extra).data
            ]

        with ThreadPoolExecutor(40) as pool:
            together = list(pool.map(ask, range(40)))
        counters = runner.counters
        assert counters.jobs["ok"] == 40 and counters.batch_requests == 40
        assert counters.batches < 40 and counters.batch_slots == 4 * counters.batches
        alone_before = counters.batches
        alone = [ask(i) for i in (0, 13, 27, 39)]
        assert counters.batches == alone_before + 4  # each ran in a batch of its own
        assert alone == [together[i] for i in (0, 13, 27, 39)]
        assert len({png for pngs in together for png in pngs}) == 40
    finally:
        server.close()
        runner.close()


@pytest.mark.slow
def test_soak_keeps_memory_and_the_url_cache_flat(embedded: Any) -> None:
    """200 sequential URL requests (random seeds): the process's RSS grows by less than 50 MB and the URL
    cache holds at most its bound, the oldest images gone."""
    cache_mb = 0.01  # a few dozen 16x16 PNGs
    server, runner = _serve(embedded, Limits.for_device("cpu", cache_mb=cache_mb))
    try:
        client = _client(server.url)
        request = {"prompt": PROMPTS[3], "response_format": "url", **TINY}
        urls = [client.images.generate(**request).data[0].url for _ in range(10)]  # warm-up
        gc.collect()
        rss_before, most = rss_bytes(), 0
        for i in range(200):
            urls.append(client.images.generate(**request).data[0].url)
            if i % 10 == 9:
                samples = _samples(httpx.get(f"{server.url}/metrics").text)
                most = max(most, int(samples["qwen_image_image_cache_bytes"]))
        gc.collect()
        growth_mb = (rss_bytes() - rss_before) / 2**20
        print(f"soak: RSS growth {growth_mb:.1f} MB, URL cache at most {most} bytes")
        assert growth_mb < 50
        assert most <= cache_mb * 2**20
        assert httpx.get(urls[0]).status_code == 404 and httpx.get(urls[-1]).status_code == 200
    finally:
        server.close()
        runner.close()


@pytest.fixture()
def with_demo() -> Iterator[tuple[FakePipe, str, Runner]]:
    """The API and the web demo at /ui on one port, one runner."""
    from qwen_image_fusion.ui.app import build_app

    pipe = FakePipe(delay=0.02)
    limits = Limits(max_work=100, time_limit_s=60)
    runner = Runner(pipe, limits)
    server = InThread(build_server(pipe, runner, demo=build_app(pipe, limits, runner)))
    try:
        yield pipe, server.url, runner
    finally:
        server.close()
        runner.close()


def test_demo_and_api_share_one_port_and_one_queue(with_demo: tuple[FakePipe, str, Runner]) -> None:
    from gradio_client import Client

    pipe, url, runner = with_demo
    assert httpx.get(url).headers["location"] == "/ui/"
    page = Client(f"{url}/ui/", verbose=False, analytics_enabled=False)
    running = page.submit("from the page", num_inference_steps=200, api_name="/generate")
    wait_for(lambda: pipe.steps_run > 0)
    with ThreadPoolExecutor(1) as pool:
        api = pool.submit(_client(url).images.generate, prompt="from the API", size="32x16")
        wait_for(lambda: runner.queue_depth() == 1)  # waits behind the page's job, in the same queue
        assert page.predict(api_name="/stop").startswith("Stopped after")
        assert len(api.result(10).data) == 1
    assert running.result(timeout=10)[0] == []
    assert [call["prompt"] for call in pipe.calls] == ["from the page", "from the API"]


@pytest.mark.browser
def test_the_page_generates_next_to_the_api(with_demo: tuple[FakePipe, str, Runner]) -> None:
    from helpers import CHROMIUM
    from playwright import sync_api

    pipe, url, _ = with_demo
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox"])
        page = browser.new_page()
        page.goto(f"{url}/ui/")
        page.locator("#prompt textarea").fill("a page request")
        page.locator("#generate").click()
        sync_api.expect(page.locator("#details")).to_contain_text("Seed:", timeout=30_000)
        sync_api.expect(page.locator("#gallery img").first).to_be_visible()
        assert len(_client(url).images.generate(prompt="and an API one").data) == 1
        browser.close()
    assert [call["prompt"] for call in pipe.calls] == ["a page request", "and an API one"]


def _samples(text: str) -> dict[str, str]:
    """Prometheus text as {name{labels}: value}."""
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
