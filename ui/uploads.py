"""What the web demo accepts on Gradio's upload route. Gradio has one upload route and one app-wide size cap
(`max_file_size`); an upload does not say which input it is for. So the demo sets that cap to the largest
file any of its inputs takes, and enforces per input kind itself:

- without an Edit tab (a text-to-image model) nothing takes files: Gradio refuses uploads above 1 kB;
- with one (a model that edits) Gradio's cap is the Edit tab's byte cap, and `UploadGuard` (ASGI
  middleware before Gradio, on every multipart request: the upload route and Gradio's other routes that
  take files) refuses one holding any file above 1 kB that is not an image within the pixel cap: the Edit
  tab's image inputs get image-sized uploads, nothing else does.
"""

import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import IO, Any

import PIL.Image
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from qwen_image_fusion.pipelines.images import MAX_INPUT_BYTES
from qwen_image_fusion.pipelines.limits import MAX_INPUT_PIXELS

NO_FILES = 1024  # bytes: what Gradio's upload route takes when no input takes files
MAX_FILES_PER_UPLOAD = 4  # one upload request's files (the page sends one; a model takes at most 4)
SPOOL_BYTES = 2**20  # an upload body past this waits in a temporary file, not in memory
CHUNK_BYTES = 2**16


def upload_caps() -> str:
    """The Edit tab's caps in words, for `qwen-image ui --help` and the page."""
    return (
        f"images up to {MAX_INPUT_BYTES / 2**20:g} MB and {MAX_INPUT_PIXELS / 1e6:.1f} MP (4096x4096) each; "
        f"other uploads are refused above {NO_FILES // 1024} kB"
    )


def upload_options(edits: bool) -> dict[str, Any]:
    """`demo.launch` keyword arguments for the demo's uploads: 1 kB without an Edit tab; with one, the Edit
    tab's byte cap and the guard that keeps everything but images at 1 kB."""
    if not edits:
        return {"max_file_size": NO_FILES}
    return {"max_file_size": MAX_INPUT_BYTES, "app_kwargs": {"middleware": [Middleware(UploadGuard)]}}


class UploadGuard:
    """Refuses (413, one line) a multipart request holding a file above 1 kB that is not an image Pillow
    reads within the pixel cap, or a body larger than the images it may hold; passes the rest on. The body
    is spooled to a temporary file past 1 MB, so a large upload does not sit in memory."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST" and _multipart(scope)):
            await self.app(scope, receive, send)
            return
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as body:
            complete = await _read_body(receive, body, MAX_FILES_PER_UPLOAD * MAX_INPUT_BYTES + 2**20)
            problem = await _problem(scope, body) if complete else f"this server takes {upload_caps()}"
            if problem is not None:
                await PlainTextResponse(problem, status_code=413)(scope, receive, send)
                return
            messages = _messages(body)

            async def replay() -> dict[str, Any]:
                """The spooled body again, then the client's own messages (its disconnect, when it comes)."""
                message = next(messages, None)
                return message if message is not None else await receive()

            await self.app(scope, replay, send)


def _messages(body: IO[bytes]) -> Iterator[dict[str, Any]]:
    """ASGI request messages carrying `body` from its start, the last one without `more_body`."""
    body.seek(0)
    chunk = body.read(CHUNK_BYTES)
    while True:
        following = body.read(CHUNK_BYTES)
        yield {"type": "http.request", "body": chunk, "more_body": bool(following)}
        if not following:
            return
        chunk = following


def _multipart(scope: Scope) -> bool:
    return Headers(scope=scope).get("content-type", "").startswith("multipart/")


async def _read_body(receive: Receive, body: IO[bytes], limit: int) -> bool:
    """Write the request body into `body`; whether it ended within `limit` bytes (reading stops past it)."""
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return False
        body.write(chunk)
        if not message.get("more_body", False):
            return True


async def _problem(scope: Scope, body: IO[bytes]) -> str | None:
    """Why this upload body is refused, or None."""

    async def stream() -> AsyncIterator[bytes]:
        body.seek(0)
        while chunk := body.read(CHUNK_BYTES):
            yield chunk

    headers = Headers(scope=scope)
    try:
        form = await MultiPartParser(headers, stream(), max_files=MAX_FILES_PER_UPLOAD).parse()
    except MultiPartException as err:
        return f"not an upload this server takes: {err.message}"
    try:
        for _, value in form.multi_items():
            if isinstance(value, UploadFile) and (value.size or 0) > NO_FILES:
                problem = _image_problem(value)
                if problem is not None:
                    return f"{value.filename}: {problem}; this server takes {upload_caps()}"
    finally:
        await form.close()
    return None


def _image_problem(upload: UploadFile) -> str | None:
    """Why a file above 1 kB is not one of the Edit tab's images, or None (read from its header)."""
    if (upload.size or 0) > MAX_INPUT_BYTES:
        return f"{upload.size / 2**20:.1f} MB"
    try:
        with PIL.Image.open(upload.file) as image:
            width, height = image.size
    except (PIL.UnidentifiedImageError, OSError):
        return "not an image"
    if width * height > MAX_INPUT_PIXELS:
        return f"{width}x{height} pixels"
    return None
