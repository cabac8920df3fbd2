"""The images the HTTP server answers with: encoded as PNG (ISA-L's deflate, several times faster than
Pillow's zlib), JPEG or WebP, a response's images in parallel on a small shared thread pool, and kept for URL
responses in a bounded cache (ui/server.py)."""

import asyncio
import io
import os
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import PIL.Image
from isal import isal_zlib

PNG_LEVEL = 1  # ISA-L deflate level: 1024x1024 noise in 3.9 ms against Pillow level 1 105 ms (2-core EPYC)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ZLIB_HEADER = (
    b"\x78\x01"  # deflate, 32 KiB window, the fastest level's flag; its check bits make 0x7801 % 31 == 0
)
DEFLATE_THREADS = min(8, os.cpu_count() or 1)  # a PNG's slices deflated at once (ISA-L releases the GIL)
DEFLATE_MIN_SLICE = 256 * 1024  # bytes: smaller images are deflated in one piece
DEFLATERS = ThreadPoolExecutor(DEFLATE_THREADS, thread_name_prefix="png-deflate")
PNG_COLOR_TYPES = {"L": 0, "RGB": 2, "LA": 4, "RGBA": 6}  # the 8-bit modes our pipelines decode to
PNG_UP_FILTER = 2  # every row stored as its difference from the row above (the PNG spec's filter type 2)
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
    if encoding.format == "png":
        return png_bytes(image)
    buffer = io.BytesIO()
    if encoding.format == "jpeg" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    image.save(buffer, format=encoding.format.upper(), quality=encoding.compression)
    return buffer.getvalue()


def png_bytes(image: PIL.Image.Image) -> bytes:
    """`image` as a PNG file: every row Up-filtered with numpy and deflated by ISA-L in parallel slices
    (Pillow's encoder spent most of a served 1024x1024 request's overhead in zlib and filter choice)."""
    color_type = PNG_COLOR_TYPES.get(image.mode)
    if color_type is None:
        raise ValueError(
            f"cannot write a {image.mode} image as PNG: expected one of {sorted(PNG_COLOR_TYPES)}"
        )
    rows = np.asarray(image).reshape(image.height, -1)
    filtered = np.empty((image.height, rows.shape[1] + 1), dtype=np.uint8)
    filtered[:, 0] = PNG_UP_FILTER
    filtered[0, 1:] = rows[0]  # the row above the first is zeros
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])  # modulo 256, as the filter defines it
    header = struct.pack(">IIBBBBB", image.width, image.height, 8, color_type, 0, 0, 0)
    chunks = [(b"IHDR", header), (b"IDAT", _zlib_stream(memoryview(filtered).cast("B"))), (b"IEND", b"")]
    return b"".join([PNG_SIGNATURE, *(part for kind, body in chunks for part in _png_chunk(kind, body))])


def _zlib_stream(data: memoryview) -> bytes:
    """`data` as one zlib stream, its slices deflated at once on DEFLATERS (pigz's way: each slice but the
    last ends on a byte boundary with a sync flush, so the raw pieces concatenate into one deflate stream;
    ISA-L releases the GIL). Slices start without their predecessor's window: a little less compression."""
    count = max(1, min(DEFLATE_THREADS, len(data) // DEFLATE_MIN_SLICE))
    bounds = [len(data) * i // count for i in range(count + 1)]

    def deflate(index: int) -> bytes:
        raw = isal_zlib.compressobj(PNG_LEVEL, isal_zlib.DEFLATED, -15)  # raw deflate: no header, no checksum
        last = index == count - 1
        piece = raw.compress(data[bounds[index] : bounds[index + 1]])
        return piece + raw.flush(isal_zlib.Z_FINISH if last else isal_zlib.Z_SYNC_FLUSH)

    pieces = list(DEFLATERS.map(deflate, range(count)))
    adler = struct.pack(">I", isal_zlib.adler32(data))
    return b"".join([ZLIB_HEADER, *pieces, adler])


def _png_chunk(kind: bytes, data: bytes) -> tuple[bytes, ...]:
    """One PNG chunk's parts: length, type, data and the CRC of type and data."""
    return struct.pack(">I", len(data)), kind, data, struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))


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
