"""The images the HTTP server answers with: encoded as PNG (at a fast zlib level), JPEG or WebP, a response's
images in parallel on a small shared thread pool, and kept for URL responses in a bounded cache
(ui/server.py)."""

import asyncio
import io
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import PIL.Image

PNG_LEVEL = 1  # zlib level of the PNGs served: a 1024x1024 image encodes in milliseconds, not tens
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}  # the formats served
LOSSY = ("jpeg", "webp")  # the formats `compression` applies to
ENCODER_THREADS = min(8, os.cpu_count() or 1)  # shared by every response: a request has at most 10 images
ENCODERS = ThreadPoolExecutor(ENCODER_THREADS, thread_name_prefix="image-encode")


@dataclass(frozen=True)
class Encoding:
    """How a response's images are written: `format` one of MEDIA_TYPES; `compression` 0-100, the quality
    of a lossy format (OpenAI's `output_compression`: 100, its default, keeps the most)."""

    format: str = "png"
    compression: int = 100


def image_bytes(image: PIL.Image.Image, encoding: Encoding) -> bytes:
    """`image` as a file in `encoding`; JPEG keeps no alpha, so an RGBA image (Qwen-Image 2.1 decodes
    four channels) is written as its RGB channels, as `qwen-image generate -o x.jpg` does."""
    buffer = io.BytesIO()
    if encoding.format == "png":
        image.save(buffer, format="PNG", compress_level=PNG_LEVEL)
        return buffer.getvalue()
    if encoding.format == "jpeg" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    image.save(buffer, format=encoding.format.upper(), quality=encoding.compression)
    return buffer.getvalue()


async def encode_all(images: Sequence[PIL.Image.Image], encoding: Encoding) -> list[bytes]:
    """Every image of a response encoded at once on ENCODERS, off the event loop, in order (PIL releases the
    GIL while it compresses)."""
    loop = asyncio.get_running_loop()
    jobs = [loop.run_in_executor(ENCODERS, image_bytes, image, encoding) for image in images]
    return list(await asyncio.gather(*jobs))


class ImageCache:
    """Encoded images kept for URL responses under unguessable file names: at most `max_bytes` in all (the
    oldest go first) and none older than `keep_s` seconds."""

    def __init__(self, max_bytes: int, keep_s: float) -> None:
        self.max_bytes, self.keep_s = max_bytes, keep_s
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, extension: str = "png") -> str:
        """Keep `data`; returns its file name, NAME.`extension`."""
        name = f"{secrets.token_urlsafe(24)}.{extension}"
        with self._lock:
            self._items[name] = (time.monotonic(), data)
            self._bytes += len(data)
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
            made, data = next(iter(self._items.values()))
            if made >= oldest and self._bytes <= self.max_bytes:
                break
            self._items.popitem(last=False)
            self._bytes -= len(data)
