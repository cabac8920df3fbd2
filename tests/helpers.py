"""Shared test helpers: a host-synchronisation guard, PNG hashing, the checkout's root, where chromium is."""

import hashlib
import io
from pathlib import Path

import PIL.Image
import torch
from torch.utils._python_dispatch import TorchDispatchMode

CPU = torch.device("cpu")
CHROMIUM = Path("/usr/bin/chromium")  # Debian's chromium, driven by Playwright in the `browser` tests
# The checkout under test: subprocesses run from it, so they import its code, not an installed copy.
REPO = Path(__file__).resolve().parents[1]


class NoHostSync(TorchDispatchMode):
    """Fails on device-to-host scalar reads (`.item()`, `bool(t)`), on tensors made from host data
    (`torch.tensor(...)`), and on host-to-device copies into a model on another device.

    0-dim host scalars that torch passes to device kernels by value (SDPA's mask fill) are not syncs.
    """

    def __init__(self, device: torch.device = CPU) -> None:
        super().__init__()
        self.device = device

    def _host_to_device(self, name: str, args: tuple, kwargs: dict) -> bool:
        if self.device.type == "cpu":
            return False
        if name == "aten::_to_copy":
            return (
                args[0].device.type == "cpu"
                and torch.device(kwargs.get("device", "cpu")).type == self.device.type
            )
        if name == "aten::copy_":
            return args[1].device.type == "cpu" and args[0].device.type == self.device.type
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in ("aten::_local_scalar_dense", "aten::lift_fresh") or self._host_to_device(
            name, args, kwargs
        ):
            raise AssertionError(f"host synchronisation in the denoise step: {name}")
        return func(*args, **kwargs)


def png_sha256(image: PIL.Image.Image) -> str:
    """SHA256 of the PNG encoding, as a user comparing files would see it."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return hashlib.sha256(buf.getvalue()).hexdigest()
