"""The HTTP image server: the OpenAI Images API on FastAPI + uvicorn, and optionally the web demo on the
same port and the same job queue (`qwen-image serve`).

POST /v1/images/generations (JSON) and /v1/images/edits (multipart, one or more `image` / `image[]`
files), GET /v1/models, /health, /metrics (Prometheus text) and /v1/images/files/NAME.png, .jpeg or .webp
(URL outputs). Errors are OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with
their status codes. Every value is checked before the job queues (NaN, infinity, text where a number
belongs: 400), and the access rule, the per-request work cap, the time limit, the queue bound and the size
bounds are the demo's own (ui/access.py, ui/limits.py). A client that disconnects stops its job at once; the
worker drops its rows after the running step. Parsing a request: ui/api_request.py; encoding the images
(PNG, JPEG or WebP, in parallel) and their cache: ui/image_cache.py; /metrics: ui/metrics.py.
"""

import asyncio
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pybase64
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from qwen_image_fusion.models.errors import QwenImageError
from qwen_image_fusion.pipelines.load_options import LoadOptions
from qwen_image_fusion.ui.access import ApiKeys
from qwen_image_fusion.ui.api_request import (
    EDIT_FIELDS,
    MAX_INPUT_IMAGES,
    ApiError,
    model_id,
    openai_mask,
    read_image,
    read_job,
    run_metadata,
)
from qwen_image_fusion.ui.generation import inpaints_input, starts_from_image
from qwen_image_fusion.ui.image_cache import MEDIA_TYPES, Encoding, ImageCache, encode_all
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.metrics import HttpCounters, prometheus_text
from qwen_image_fusion.ui.runner import DISCONNECTED, SHUTTING_DOWN, Job, QueueFull, Runner, Stopped

LOG = logging.getLogger("qwen_image.server")


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

    async def answer(request: Request, job: Job, response_format: str, encoding: Encoding) -> dict[str, Any]:
        """Queue `job`, wait for it (stopping it if the client goes away) and build the response body, its
        images written in `encoding`."""
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
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()  # hand the failed run's blocks back so the next request can fit
            raise ApiError(
                503,
                "out of device memory: try a smaller size or fewer images",
                code="out_of_memory",
                kind="server_error",
            ) from None
        except Exception:
            LOG.exception("request failed")
            raise ApiError(
                500, "the server failed to generate the images (see its log)", kind="server_error"
            ) from None
        finally:
            gone.cancel()
        files = await encode_all(images, encoding)
        if response_format == "url":
            base = str(request.base_url)
            data = [{"url": f"{base}v1/images/files/{cache.put(file, encoding.format)}"} for file in files]
        else:
            data = [{"b64_json": pybase64.b64encode_as_string(file)} for file in files]
        return {
            "created": int(time.time()),
            "data": data,
            "output_format": encoding.format,
            "size": f"{run.width}x{run.height}",
            "seed": run.seed,
            "model": model_id(pipe),
            "run": run_metadata(run),
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
        """An edit model edits its input images (one that inpaints: only where the `mask` says); a
        text-to-image model that starts from images reworks the one image it is given (img2img, `strength`),
        only where the `mask` says (inpainting)."""
        authorize(request)
        takes = getattr(pipe.spec, "max_images", 0)
        starts = starts_from_image(pipe)
        if takes == 0 and not starts:
            message = f"the loaded model ({model_id(pipe)}) cannot edit images: it generates from text only"
            raise ApiError(400, message, "image", "model_cannot_edit")
        form = await request.form(
            max_files=MAX_INPUT_IMAGES,
            max_fields=len(EDIT_FIELDS) * 2,
            max_part_size=int(limits.max_body_mb * mb),
        )
        try:
            if "mask" in form and not (starts or inpaints_input(pipe)):
                message = f"mask is not supported by {model_id(pipe)}: it edits whole images"
                raise ApiError(400, message, "mask")
            files = [item for name in ("image", "image[]") for item in form.getlist(name)]
            if not files or any(isinstance(item, str) for item in files):
                raise ApiError(400, "give one or more input images as files named image or image[]", "image")
            most = 1 if starts else takes
            if len(files) > most:
                raise ApiError(
                    400, f"{len(files)} input images, but {model_id(pipe)} takes at most {most}", "image"
                )
            images = [read_image(await item.read(), f"image {i}") for i, item in enumerate(files, 1)]
            mask = form.get("mask")
            if isinstance(mask, str):
                raise ApiError(400, "mask must be an image file", "mask")
            mask = None if mask is None else openai_mask(read_image(await mask.read(), "mask", "mask"))
            values = {name: form.get(name) for name in form if name not in ("image", "image[]", "mask")}
            for name, value in values.items():
                if not isinstance(value, str):
                    raise ApiError(400, f"{name} must be a form field, not a file", name)
        finally:
            await form.close()
        if starts:
            return await answer(request, *read_job(values, pipe, limits, variant, start=(images[0], mask)))
        return await answer(request, *read_job(values, pipe, limits, variant, images, mask=mask))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        entry = {"id": model_id(pipe), "object": "model", "created": 0, "owned_by": "qwen-image-fusion"}
        return {"object": "list", "data": [entry]}

    @app.get("/v1/images/files/{name}")
    async def image_file(name: str) -> Response:
        """A URL response's image: NAME.png, .jpeg or .webp, as the response named it."""
        data = cache.get(name)
        if data is None:
            raise ApiError(
                404,
                f"image {name} is not here (images are kept {limits.keep_images_minutes:g} min)",
                code="not_found",
            )
        return Response(data, media_type=MEDIA_TYPES[name.rpartition(".")[2]])

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

        from qwen_image_fusion.ui.app import takes_images
        from qwen_image_fusion.ui.uploads import upload_options

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


def serve(
    options: LoadOptions,
    host: str,
    port: int,
    lora_files: list[Path] | None = None,
    limits: dict[str, Any] | None = None,
    keys: list[str] | None = None,
    ui: bool = False,
    max_batch: int = 1,
    window_s: float = 0.02,
    on_start: Callable[[int, Limits, str, str], None] | None = None,
) -> None:
    """Load the model once and serve the API (and with `ui` the demo at /ui) until interrupted: the entry
    point of `qwen-image serve`. `lora_files` are mounted at scale 0 (requests set `lora_scales`);
    `limits`: Limits fields over the device's defaults; `max_batch`: image rows per denoising step (1:
    every request alone); `on_start(port, limits, batching, memory)` runs once the server listens
    (`memory`: the plan's summary when it keeps weights off the device, else "")."""
    import uvicorn

    from qwen_image_fusion.pipelines.batching import BatchPlan
    from qwen_image_fusion.pipelines.pipeline import Pipeline
    from qwen_image_fusion.ui.lora_controls import load_lora_files

    pipe = Pipeline.load(options)
    if lora_files:
        load_lora_files(pipe, lora_files)
    applied = Limits.for_device(pipe.device.type, **(limits or {}))
    planned = pipe.memory is not None
    plan = BatchPlan.for_device(pipe.device, max_batch, planned) if max_batch > 1 else None
    runner = Runner(pipe, applied, plan, window_s)
    demo = None
    if ui:
        from qwen_image_fusion.ui.app import build_app

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
    memory = "" if pipe.memory is None or pipe.memory.plan.resident else pipe.memory.plan.summary()

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started and on_start is not None:
            on_start(port, applied, batching, memory)

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
