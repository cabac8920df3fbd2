"""The PNGs the HTTP server answers with: encoded at a fast zlib level, and kept for URL responses in a
bounded cache (ui/server.py)."""

import io
import secrets
import threading
import time
from collections import OrderedDict

import PIL.Image

PNG_LEVEL = 1  # zlib level of the PNGs served: a 1024x1024 image encodes in milliseconds, not tens


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
