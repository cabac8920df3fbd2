"""The HTTP API's routes, on a router the app factory (ui/server.py) includes: POST /v1/images/generations
(JSON) and /v1/images/edits (multipart), GET /v1/models, /health, /metrics (Prometheus text),
/v1/images/files/NAME and /openapi.json (the request bodies' schemas, from the declared request options).
Each handler reads the server's state from `request.app.state` (pipe, runner, keys, limits, variant, image
cache, HTTP counters)."""

import asyncio
import json
import logging
import math
import time
from typing import Any

import pybase64
import torch
from fastapi import APIRouter, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response

from qwen_image_fusion.models.errors import QwenImageError
from qwen_image_fusion.pipelines.options import EDITS, GENERATIONS
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
from qwen_image_fusion.ui.api_schema import request_body
from qwen_image_fusion.ui.generation import inpaints_input, starts_from_image
from qwen_image_fusion.ui.image_cache import MEDIA_TYPES, Encoding, encode_all
from qwen_image_fusion.ui.metrics import prometheus_text
from qwen_image_fusion.ui.runner import DISCONNECTED, SHUTTING_DOWN, Job, QueueFull, Stopped

LOG = logging.getLogger("qwen_image.server")
router = APIRouter()


def authorize(request: Request) -> None:
    """ApiError 401 unless the request bears one of the server's API keys (none needed without keys)."""
    keys = request.app.state.keys
    if keys is None:
        return
    header = request.headers.get("authorization")
    if not keys.authorize(header):
        problem = "missing API key: send Authorization: Bearer KEY" if header is None else "incorrect API key"
        raise ApiError(401, problem, code="invalid_api_key")


async def answer(request: Request, job: Job, response_format: str, encoding: Encoding) -> dict[str, Any]:
    """Queue `job`, wait for it (stopping it if the client goes away) and build the response body, its
    images written in `encoding`."""
    state = request.app.state
    try:
        future = asyncio.wrap_future(state.runner.submit(job))
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
        data = [{"url": f"{base}v1/images/files/{state.cache.put(file, encoding.format)}"} for file in files]
    else:
        data = [{"b64_json": pybase64.b64encode_as_string(file)} for file in files]
    return {
        "created": int(time.time()),
        "data": data,
        "output_format": encoding.format,
        "size": f"{run.width}x{run.height}",
        "seed": run.seed,
        "model": model_id(state.pipe),
        "run": run_metadata(run),
    }


@router.post("/v1/images/generations", openapi_extra=request_body(GENERATIONS))
async def generations(request: Request) -> dict[str, Any]:
    """A text-to-image request (JSON); a ControlNet checkpoint's control images ride along as base64."""
    authorize(request)
    state = request.app.state
    body = await request.body()
    try:
        values = json.loads(body)
    except ValueError as err:
        raise ApiError(400, f"the request body is not JSON: {err}") from None
    if not isinstance(values, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return await answer(request, *read_job(values, state.pipe, state.limits, state.variant))


@router.post("/v1/images/edits", openapi_extra=request_body(EDITS))
async def edits(request: Request) -> dict[str, Any]:
    """An edit model edits its input images (one that inpaints: only where the `mask` says); a
    text-to-image model that starts from images reworks the one image it is given (img2img, `strength`),
    only where the `mask` says (inpainting)."""
    authorize(request)
    state = request.app.state
    pipe, limits, variant = state.pipe, state.limits, state.variant
    takes = getattr(pipe.spec, "max_images", 0)
    starts = starts_from_image(pipe)
    if takes == 0 and not starts:
        message = f"the loaded model ({model_id(pipe)}) cannot edit images: it generates from text only"
        raise ApiError(400, message, "image", "model_cannot_edit")
    form = await request.form(
        max_files=MAX_INPUT_IMAGES,
        max_fields=len(EDIT_FIELDS) * 2,
        max_part_size=int(limits.max_body_mb * 2**20),
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


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    authorize(request)
    entry = {
        "id": model_id(request.app.state.pipe),
        "object": "model",
        "created": 0,
        "owned_by": "qwen-image-fusion",
    }
    return {"object": "list", "data": [entry]}


@router.get("/v1/images/files/{name}")
async def image_file(name: str, request: Request) -> Response:
    """A URL response's image: NAME.png, .jpeg or .webp, as the response named it."""
    state = request.app.state
    data = state.cache.get(name)
    if data is None:
        raise ApiError(
            404,
            f"image {name} is not here (images are kept {state.limits.keep_images_minutes:g} min)",
            code="not_found",
        )
    return Response(data, media_type=MEDIA_TYPES[name.rpartition(".")[2]])


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    state = request.app.state
    pipe, runner = state.pipe, state.runner
    return {
        "status": "ok",
        "model": model_id(pipe),
        "device": str(pipe.device),
        "queue_depth": runner.queue_depth(),
        "running": len(runner.jobs()) - runner.queue_depth(),
    }


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    authorize(request)
    state = request.app.state
    return PlainTextResponse(
        prometheus_text(state.runner, state.cache, state.http, state.pipe.device),
        media_type="text/plain; version=0.0.4",
    )


@router.get("/openapi.json")
async def openapi(request: Request) -> dict[str, Any]:
    """The API's OpenAPI document: its routes and their request bodies (ui/api_schema.py)."""
    authorize(request)
    app = request.app
    return get_openapi(title=app.title, version=app.version, routes=app.routes)


async def _disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
