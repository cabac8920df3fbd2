"""The HTTP image server: the OpenAI Images API on FastAPI + uvicorn, and optionally the web demo on the
same port and the same job queue (`qwen-image serve`).

POST /v1/images/generations (JSON) and /v1/images/edits (multipart, one or more `image` / `image[]`
files), GET /v1/models, /health, /metrics (Prometheus text) and /v1/images/files/NAME.png (URL outputs).
Errors are OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with their status
codes. Every value is checked before the job queues (NaN, infinity, text where a number belongs: 400),
and the access rule, the per-request work cap, the time limit, the queue bound and the size bounds are
the demo's own (ui/access.py, ui/limits.py). A client that disconnects stops its job at once; the
worker drops its rows after the running step.
"""

import asyncio
import base64
import io
import json
import logging
import math
import re
import secrets
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import PIL.Image
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from models.errors import QwenImageError
from pipelines.limits import MAX_INPUT_PIXELS
from pipelines.presets import PRESETS
from ui.access import ApiKeys
from ui.generation import (
    FieldError,
    check_values,
    check_work,
    number_field,
    random_seed,
    text_field,
    whole_field,
)
from ui.limits import Limits
from ui.runner import DISCONNECTED, SHUTTING_DOWN, Job, QueueFull, Runner, Stopped

LOG = logging.getLogger("qwen_image.server")
MAX_IMAGES_PER_REQUEST = 10  # OpenAI's bound on `n`
MAX_INPUT_IMAGES = 16  # files one edit request may carry (the model's own bound is checked too)
RESPONSE_FORMATS = ("b64_json", "url")
SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
IGNORED = ("user", "quality", "style", "moderation")  # OpenAI fields that change nothing here
FIELDS = (
    "prompt",
    "model",
    "n",
    "size",
    "response_format",
    "output_format",
    "seed",
    "negative_prompt",
    "num_inference_steps",
    "true_cfg_scale",
    "preset",
    "lora_scales",
    *IGNORED,
)
EDIT_FIELDS = (*FIELDS, "image", "image[]")
PNG_LEVEL = 1  # zlib level of the PNGs served: a 1024x1024 image encodes in milliseconds, not tens


class ApiError(Exception):
    """An error answered in OpenAI's shape: `status`, message, the parameter it concerns, a code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, self.status, headers=self.headers)


def model_id(pipe: Any) -> str:
    """The id /v1/models lists: the checkpoint directory's name (or the embedded default's)."""
    return Path(pipe.model_name).name or pipe.model_name


def read_job(
    values: Mapping[str, Any], pipe: Any, limits: Limits, variant: str, images: list | None = None
) -> tuple[Job, str]:
    """Check every value of an Images API request and build its Job on `variant` (fully resolved: size,
    steps, CFG scale, negative prompt, seed and every loaded LoRA's scale, so no earlier request's state
    reaches it) and its response format; ApiError (400) names the first bad one. Multipart values arrive as
    text; a number field's text is read as a number."""
    allowed = EDIT_FIELDS if images is not None else FIELDS
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ApiError(400, f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
    try:
        return _job_of(values, pipe, limits, variant, images, text_numbers=images is not None)
    except FieldError as err:
        raise ApiError(400, str(err), err.field, "invalid_value") from None


def _job_of(
    values: Mapping[str, Any],
    pipe: Any,
    limits: Limits,
    variant: str,
    images: list | None,
    text_numbers: bool,
) -> tuple[Job, str]:
    def number(name: str, whole: bool) -> Any:
        value = values.get(name)
        if value is None:
            return None
        if text_numbers and isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eEnN") else int(value)
            except ValueError:
                raise FieldError(name, f"{name} must be a number, not {value!r}") from None
        return whole_field(name, value) if whole else number_field(name, value)

    served = values.get("model")
    if served is not None and served not in (model_id(pipe), pipe.model_name):
        raise FieldError(
            "model", f"model {served!r} is not served here: this server serves {model_id(pipe)!r}"
        )
    prompt = text_field("prompt", values.get("prompt"))
    preset_name = values.get("preset")
    if preset_name is not None and preset_name not in PRESETS:
        raise FieldError("preset", f"preset {preset_name!r} is not one of {', '.join(PRESETS)}")
    preset = PRESETS.get(preset_name) if preset_name else None
    suggested = preset or pipe.defaults
    steps = number("num_inference_steps", whole=True)
    steps = suggested.num_inference_steps if steps is None else steps
    scale = number("true_cfg_scale", whole=False)
    scale = suggested.true_cfg_scale if scale is None else scale
    negative = values.get("negative_prompt")
    negative = pipe.defaults.negative_prompt if negative is None else text_field("negative_prompt", negative)
    n = number("n", whole=True)
    n = 1 if n is None else n
    if not 1 <= n <= MAX_IMAGES_PER_REQUEST:
        raise FieldError("n", f"n {n} must be between 1 and {MAX_IMAGES_PER_REQUEST}")
    seed = number("seed", whole=True)
    width, height = _size(values.get("size"), pipe, images)
    response_format = values.get("response_format") or "b64_json"
    if response_format not in RESPONSE_FORMATS:
        raise FieldError("response_format", f"response_format {response_format!r} must be b64_json or url")
    if values.get("output_format") not in (None, "png"):
        raise FieldError("output_format", "output_format must be png: this server writes PNG images")
    for name in IGNORED:
        if values.get(name) is not None and not isinstance(values[name], str):
            raise FieldError(name, f"{name} must be text")
    kwargs: dict[str, Any] = {
        "prompt": prompt,
        "negative_prompt": negative,
        "width": width,
        "height": height,
        "num_inference_steps": steps,
        "true_cfg_scale": scale,
        "seed": random_seed() if seed is None else seed,
        "num_images_per_prompt": n,
        "preset": preset_name or None,
    }
    scales = _lora_scales(values.get("lora_scales"), getattr(pipe, "loras", {}), text_numbers)
    if scales:
        kwargs["lora_scales"] = scales
    if images:
        kwargs["image"] = images
    check_values(kwargs, pipe.size_multiple, API_FIELDS)
    job = Job(None, variant, kwargs)
    check_work(job, limits)
    return job, response_format


API_FIELDS = {name: name for name in FIELDS} | {
    "width": "size",
    "height": "size",
    "num_images_per_prompt": "n",
}


def _size(value: Any, pipe: Any, images: list | None) -> tuple[int, int]:
    """(width, height) of a `size` "WxH"; "auto" or none: the model's default (for an edit, the size the
    model picks for its input images)."""
    if value in (None, "auto"):
        picked = pipe.model.default_size(images) if images else None
        return picked or (pipe.defaults.width, pipe.defaults.height)
    match = SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise FieldError("size", f"size {value!r} must be WIDTHxHEIGHT in pixels, such as 1024x1024, or auto")
    return int(match[1]), int(match[2])


def _lora_scales(value: Any, loaded: Mapping[str, Any], text: bool) -> dict[str, float]:
    """{LoRA name: scale} for every LoRA the server has loaded: those the request names (multipart: as JSON
    text) at its scales, the others at 0 (off)."""
    off = dict.fromkeys(loaded, 0.0)
    if value is None:
        return off
    if text and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise FieldError("lora_scales", "lora_scales must be a JSON object of {name: scale}") from None
    if not isinstance(value, dict):
        raise FieldError("lora_scales", "lora_scales must be an object of {LoRA name: scale}")
    for name, scale in value.items():
        if name not in loaded:
            served = ", ".join(loaded) or "none"
            raise FieldError("lora_scales", f"LoRA {name!r} is not loaded here (loaded: {served})")
        number_field("lora_scales", scale)
    return off | {name: float(scale) for name, scale in value.items()}


def read_image(data: bytes, index: int) -> PIL.Image.Image:
    """An uploaded file as a loaded PIL image; ApiError (400) when it is not an image PIL reads or has more
    than MAX_INPUT_PIXELS pixels (checked from its header, before its pixels are decoded)."""
    try:
        image = PIL.Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_INPUT_PIXELS:
            raise ApiError(
                400,
                f"image {index} is {image.width}x{image.height}: at most {MAX_INPUT_PIXELS / 1e6:.1f} MP",
                "image",
                "image_too_large",
            )
        image.load()
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as err:
        raise ApiError(400, f"image {index} is not an image this server reads ({err})", "image") from None
    return image


def png_bytes(image: PIL.Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_LEVEL)
    return buffer.getvalue()


class ImageCache:
    """PNGs kept for URL responses under unguessable names: at most `max_bytes` in all (the oldest go
    first) and none older than `keep_s` seconds."""

    def __init__(self, max_bytes: int, keep_s: float) -> None:
        self.max_bytes, self.keep_s = max_bytes, keep_s
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, png: bytes) -> str:
        """Keep `png`; returns its name."""
        name = secrets.token_urlsafe(24)
        with self._lock:
            self._items[name] = (time.monotonic(), png)
            self._bytes += len(png)
            self._clean()
        return name

    def get(self, name: str) -> bytes | None:
        with self._lock:
            self._clean()
            item = self._items.get(name)
        return None if item is None else item[1]

    def usage(self) -> tuple[int, int]:
        """(images, bytes) held now."""
        with self._lock:
            self._clean()
            return len(self._items), self._bytes

    def _clean(self) -> None:
        oldest = time.monotonic() - self.keep_s
        while self._items:
            made, png = next(iter(self._items.values()))
            if made >= oldest and self._bytes <= self.max_bytes:
                break
            self._items.popitem(last=False)
            self._bytes -= len(png)


class HttpCounters:
    """Requests answered, by route and status, and the seconds they took, for /metrics."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.counts[route, status] = self.counts.get((route, status), 0) + 1
            self.seconds[route] = self.seconds.get(route, 0.0) + seconds


class Gate:
    """ASGI middleware in front of the API: a request whose body passes `max_bytes(path)` (None: no bound)
    is answered 413, by its Content-Length before anything is read, else as soon as the bytes read pass
    it (the route's reading raises the error); and every answer is counted by route and status."""

    def __init__(self, app: Any, max_bytes: Callable[[str], int | None], http: HttpCounters) -> None:
        self.app, self.max_bytes, self.http = app, max_bytes, http

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def sent(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, self._bounded(scope, receive), sent)
        finally:
            route = getattr(scope.get("route"), "path", "other")
            self.http.add(route, status, time.perf_counter() - start)

    def _bounded(self, scope: dict, receive: Callable) -> Callable[[], Awaitable[dict]]:
        limit = self.max_bytes(scope["path"])
        if limit is None:
            return receive
        error = ApiError(
            413, f"the request body is larger than this server takes ({limit} bytes)", code="too_large"
        )
        length = dict(scope["headers"]).get(b"content-length", b"")
        seen = 0

        async def bounded() -> dict:
            nonlocal seen
            if length.isdigit() and int(length) > limit:
                raise error
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise error
            return message

        return bounded


def build_server(
    pipe: Any,
    runner: Runner,
    keys: ApiKeys | None = None,
    demo: Any = None,
) -> FastAPI:
    """The API around a loaded pipeline and its runner (the runner's limits apply). `keys`: the API keys a
    request must bear (None: none needed). `demo`: a Gradio Blocks built on the same runner, mounted at /ui
    (its sign-in takes any user name and an API key as the password)."""
    limits = runner.limits
    variant = pipe.variant  # the API's, whatever variant the demo's requests switch to
    cache = ImageCache(int(limits.cache_mb * 2**20), limits.keep_images_minutes * 60)
    http = HttpCounters()
    app = FastAPI(title="Qwen-Image", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.cache, app.state.http = cache, http
    mb = 2**20

    def body_limit(path: str) -> int | None:
        if path == "/v1/images/edits":
            return int(limits.max_upload_mb * mb)
        return int(limits.max_body_mb * mb) if path.startswith("/v1/") else None

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = "no such route: see docs/API.md" if err.status_code == 404 else str(err.detail)
        return ApiError(
            err.status_code, message, code="not_found" if err.status_code == 404 else None
        ).response()

    def authorize(request: Request) -> None:
        if keys is None:
            return
        header = request.headers.get("authorization")
        if not keys.authorize(header):
            problem = (
                "missing API key: send Authorization: Bearer KEY" if header is None else "incorrect API key"
            )
            raise ApiError(401, problem, code="invalid_api_key")

    async def answer(request: Request, job: Job, response_format: str) -> dict[str, Any]:
        """Queue `job`, wait for it (stopping it if the client goes away) and build the response body."""
        try:
            future = asyncio.wrap_future(runner.submit(job))
        except QueueFull as err:
            retry = str(math.ceil(err.retry_after_s))
            raise ApiError(
                429, str(err), code="queue_full", kind="rate_limit_error", headers={"Retry-After": retry}
            ) from None
        except QwenImageError as err:
            raise ApiError(503, str(err), code="unavailable", kind="server_error") from None
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not future.done():
                job.stop(DISCONNECTED)
            images, run = await future
        except Stopped as err:
            if err.reason == SHUTTING_DOWN:
                raise ApiError(503, str(err), code="shutting_down", kind="server_error") from None
            raise ApiError(400, str(err), code="stopped") from None
        except QwenImageError as err:
            raise ApiError(400, str(err), code="invalid_value") from None
        except Exception as err:
            if type(err).__name__ == "OutOfMemoryError":
                _free_device_memory()
                raise ApiError(
                    503,
                    "out of device memory: try a smaller size or fewer images",
                    code="out_of_memory",
                    kind="server_error",
                ) from None
            LOG.exception("request failed")
            raise ApiError(
                500, "the server failed to generate the images (see its log)", kind="server_error"
            ) from None
        finally:
            gone.cancel()
        pngs = await asyncio.to_thread(lambda: [png_bytes(image) for image in images])
        if response_format == "url":
            base = str(request.base_url)
            data = [{"url": f"{base}v1/images/files/{cache.put(png)}.png"} for png in pngs]
        else:
            data = [{"b64_json": base64.b64encode(png).decode("ascii")} for png in pngs]
        k = job.kwargs
        return {
            "created": int(time.time()),
            "data": data,
            "output_format": "png",
            "size": f"{k['width']}x{k['height']}",
            "seed": run.seed,
            "model": model_id(pipe),
        }

    @app.post("/v1/images/generations")
    async def generations(request: Request) -> dict[str, Any]:
        authorize(request)
        body = await request.body()
        try:
            values = json.loads(body)
        except ValueError as err:
            raise ApiError(400, f"the request body is not JSON: {err}") from None
        if not isinstance(values, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return await answer(request, *read_job(values, pipe, limits, variant))

    @app.post("/v1/images/edits")
    async def edits(request: Request) -> dict[str, Any]:
        authorize(request)
        takes = getattr(pipe.spec, "max_images", 0)
        if takes == 0:
            message = f"the loaded model ({model_id(pipe)}) cannot edit images: it generates from text only"
            raise ApiError(400, message, "image", "model_cannot_edit")
        form = await request.form(
            max_files=MAX_INPUT_IMAGES,
            max_fields=len(EDIT_FIELDS) * 2,
            max_part_size=int(limits.max_body_mb * mb),
        )
        try:
            if "mask" in form:
                raise ApiError(400, "mask is not supported: this server edits whole images", "mask")
            files = [item for name in ("image", "image[]") for item in form.getlist(name)]
            if not files or any(isinstance(item, str) for item in files):
                raise ApiError(400, "give one or more input images as files named image or image[]", "image")
            if len(files) > takes:
                raise ApiError(
                    400, f"{len(files)} input images, but {model_id(pipe)} takes at most {takes}", "image"
                )
            images = [read_image(await item.read(), i) for i, item in enumerate(files, 1)]
            values = {name: form.get(name) for name in form if name not in ("image", "image[]")}
            for name, value in values.items():
                if not isinstance(value, str):
                    raise ApiError(400, f"{name} must be a form field, not a file", name)
        finally:
            await form.close()
        return await answer(request, *read_job(values, pipe, limits, variant, images))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        entry = {"id": model_id(pipe), "object": "model", "created": 0, "owned_by": "qwen-image-fusion"}
        return {"object": "list", "data": [entry]}

    @app.get("/v1/images/files/{name}.png")
    async def image_file(name: str) -> Response:
        png = cache.get(name)
        if png is None:
            raise ApiError(
                404,
                f"image {name}.png is not here (images are kept {limits.keep_images_minutes:g} min)",
                code="not_found",
            )
        return Response(png, media_type="image/png")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_id(pipe),
            "device": str(pipe.device),
            "queue_depth": runner.queue_depth(),
            "running": len(runner.jobs()) - runner.queue_depth(),
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        authorize(request)
        return PlainTextResponse(
            prometheus_text(runner, cache, http, pipe.device), media_type="text/plain; version=0.0.4"
        )

    if demo is not None:
        import gradio as gr

        from ui.app import takes_images
        from ui.uploads import upload_options

        auth = None if keys is None else (lambda user, password: keys.matches(password))
        uploads = upload_options(
            takes_images(pipe)[0]
        )  # the Edit tab's image-sized uploads, only if it has one
        gr.mount_gradio_app(app, demo, path="/ui", auth=auth, mcp_server=False, **uploads)

        @app.get("/")
        async def root() -> RedirectResponse:
            return RedirectResponse("/ui/")

    app.add_middleware(Gate, max_bytes=body_limit, http=http)
    return app


async def _disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _free_device_memory() -> None:
    import torch

    torch.cuda.empty_cache()


def prometheus_text(runner: Runner, cache: ImageCache, http: HttpCounters, device: Any) -> str:
    """/metrics in Prometheus' text format: queue, jobs, batches, stage seconds, HTTP, cache, GPU memory."""
    c = runner.counters
    queued = runner.queue_depth()
    images, cached = cache.usage()
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP qwen_image_{name} {help}", f"# TYPE qwen_image_{name} {kind}"])
        lines.extend(f"qwen_image_{name}{labels} {value:g}" for labels, value in samples)

    metric("queue_depth", "gauge", "Requests waiting for the device.", [("", queued)])
    metric("running_jobs", "gauge", "Requests on the device now.", [("", len(runner.jobs()) - queued)])
    metric("queue_size", "gauge", "Requests that may wait (more get 429).", [("", runner.limits.queue_size)])
    with c.lock:
        jobs = sorted(c.jobs.items())
        stages = [(stage, c.stage_seconds[stage], c.stage_count[stage]) for stage in c.stage_seconds]
        batches = [("", c.batches)], [("", c.batch_requests)], [("", c.batch_slots)]
    metric(
        "jobs_total",
        "counter",
        "Requests by outcome (ok, stopped, failed, queue_full).",
        [(f'{{outcome="{o}"}}', n) for o, n in jobs],
    )
    lines.extend(
        [
            "# HELP qwen_image_stage_seconds Seconds spent per pipeline stage.",
            "# TYPE qwen_image_stage_seconds summary",
        ]
    )
    for stage, seconds, count in stages:
        lines.append(f'qwen_image_stage_seconds_sum{{stage="{stage}"}} {seconds:g}')
        lines.append(f'qwen_image_stage_seconds_count{{stage="{stage}"}} {count}')
    metric("batches_total", "counter", "Batches run (requests sharing denoising steps).", batches[0])
    metric("batch_requests_total", "counter", "Requests the batches held.", batches[1])
    metric("batch_slots_total", "counter", "Slots the batches ran (requests plus padding).", batches[2])
    with http._lock:
        counts, seconds = sorted(http.counts.items()), sorted(http.seconds.items())
    metric(
        "http_requests_total",
        "counter",
        "HTTP requests answered, by route and status.",
        [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in counts],
    )
    metric(
        "http_seconds_total",
        "counter",
        "Seconds spent answering HTTP requests, by route.",
        [(f'{{route="{r}"}}', s) for r, s in seconds],
    )
    metric("image_cache_images", "gauge", "PNGs kept for URL responses.", [("", images)])
    metric("image_cache_bytes", "gauge", "Bytes of PNGs kept for URL responses.", [("", cached)])
    metric(
        "gpu_memory_bytes", "gauge", "CUDA memory of the serving device (none on a CPU).", _gpu_memory(device)
    )
    return "\n".join(lines) + "\n"


def _gpu_memory(device: Any) -> list[tuple[str, float]]:
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return []
    _, total = torch.cuda.mem_get_info(device)
    kinds = {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
        "total": total,
    }
    return [(f'{{kind="{kind}"}}', value) for kind, value in kinds.items()]


def serve(
    model: str | None,
    host: str,
    port: int,
    variant: str = "auto",
    device: str | None = None,
    dtype: str | None = None,
    lora_files: list[Path] | None = None,
    limits: dict[str, Any] | None = None,
    keys: list[str] | None = None,
    ui: bool = False,
    max_batch: int = 1,
    window_s: float = 0.02,
    on_start: Callable[[int, Limits, str], None] | None = None,
    gpu_memory: int | str | None = None,
    workload: Any = None,
) -> None:
    """Load the model once and serve the API (and with `ui` the demo at /ui) until interrupted: the entry
    point of `qwen-image serve`. `lora_files` are mounted at scale 0 (requests set `lora_scales`);
    `limits`: Limits fields over the device's defaults; `max_batch`: image rows per denoising step (1:
    every request alone); `on_start(port, limits, batching)` runs once the server listens; `gpu_memory`
    and `workload`: the memory plan (pipelines.load_pipeline)."""
    import uvicorn

    from pipelines import load_pipeline
    from pipelines.batching import BatchPlan
    from ui.lora_controls import load_lora_files

    pipe = load_pipeline(
        model=model, variant=variant, device=device, dtype=dtype, gpu_memory=gpu_memory, workload=workload
    )
    if lora_files:
        load_lora_files(pipe, lora_files)
    applied = Limits.for_device(pipe.device.type, **(limits or {}))
    plan = BatchPlan.for_device(pipe.device, max_batch) if max_batch > 1 else None
    runner = Runner(pipe, applied, plan, window_s)
    demo = None
    if ui:
        from ui.app import build_app

        demo = build_app(pipe, applied, runner)
    app = build_server(pipe, runner, ApiKeys(keys) if keys else None, demo)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        limit_concurrency=4 * applied.queue_size + 64,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    batching = "off (each request alone)" if plan is None else describe_batching(plan, window_s)

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started and on_start is not None:
            on_start(port, applied, batching)

    threading.Thread(target=announce, daemon=True).start()
    try:
        run_until_stopped(server)
    finally:
        runner.close()


def run_until_stopped(server: Any) -> None:
    """Run a uvicorn server until it stops; KeyboardInterrupt when Ctrl+C stopped it. uvicorn re-raises the
    SIGINT it caught once it has shut down, but asyncio.run's own SIGINT handler only cancels the serving
    task, which may have finished already: then the command exited 0, not 130 (seen in CI)."""
    caught: list[int] = []
    handle_exit = server.handle_exit

    def record(sig: int, frame: Any) -> None:
        caught.append(sig)
        handle_exit(sig, frame)

    server.handle_exit = record
    server.run()
    if signal.SIGINT in caught:
        raise KeyboardInterrupt


def describe_batching(plan: Any, window_s: float) -> str:
    """One line on the batching plan: rows per step, the memory bound, the window."""
    memory = "" if plan.memory_bytes is None else f", within {plan.memory_bytes / 2**30:.0f} GiB"
    return (
        f"up to {plan.max_images} images per denoising step{memory}, at fixed batch sizes, "
        f"gathered for {window_s * 1000:g} ms"
    )


class InThread:
    """A server running `app` on 127.0.0.1 in a background thread (tests and benchmarks): `url`, `close()`."""

    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        import socket

        import uvicorn

        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
        self.url = f"http://{host}:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
