"""The HTTP image server: the OpenAI Images API on FastAPI + uvicorn, and optionally the web demo on the
same port and the same job queue (`qwen-image serve`).

This module is the app factory and the process around it: the state the routes read, the error shapes,
the body-size gate, the demo mounted at /ui only when asked (Gradio is imported only then), uvicorn. The
routes are ui/api_routes.py: POST /v1/images/generations (JSON) and /v1/images/edits (multipart, one or
more `image` / `image[]` files), GET /v1/models, /health, /metrics (Prometheus text),
/v1/images/files/NAME.png, .jpeg or .webp (URL outputs) and /openapi.json. Errors are OpenAI's JSON
shape, `{"error": {"message", "type", "param", "code"}}`, with their status codes. Every value is checked
before the job queues (NaN, infinity, text where a number belongs: 400), and the access rule, the
per-request work cap, the time limit, the queue bound and the size bounds are the demo's own
(ui/access.py, ui/limits.py). A client that disconnects stops its job at once; the worker drops its rows
after the running step. Parsing a request: ui/api_request.py; encoding the images (PNG, JPEG or WebP, in
parallel) and their cache: ui/image_cache.py; /metrics: ui/metrics.py.
"""

import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qwen_image_fusion.pipelines.load_options import LoadOptions
from qwen_image_fusion.ui.access import ApiKeys
from qwen_image_fusion.ui.api_request import (
    ApiError,
)
from qwen_image_fusion.ui.api_routes import router
from qwen_image_fusion.ui.image_cache import ImageCache
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.metrics import HttpCounters
from qwen_image_fusion.ui.runner import Runner

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
    cache = ImageCache(int(limits.cache_mb * 2**20), limits.keep_images_minutes * 60)
    http = HttpCounters()
    app = FastAPI(title="Qwen-Image", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pipe, app.state.runner, app.state.keys, app.state.limits = pipe, runner, keys, limits
    app.state.variant = pipe.variant  # the API's, whatever variant the demo's requests switch to
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

    app.include_router(router)

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
    from qwen_image_fusion.pipelines.loading import load
    from qwen_image_fusion.pipelines.presets import load_lora_files

    pipe = load(options)
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
