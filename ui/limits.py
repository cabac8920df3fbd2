"""Job limits of the web demo and the HTTP server (one set, shared) and their per-device defaults; cheap to
import (`qwen-image ui --help`, `qwen-image serve --help`)."""

import dataclasses
import math
from typing import Any

from qwen_image_fusion.models.errors import InputError

# Default (max_work in megapixel-steps, time_limit_s) per device type. CUDA: about 2 minutes of FP8
# fused on an H200 (about 0.11 s per megapixel-step at 1328x1328, BENCHMARKS.md); 1328x1328 x 50 steps x
# 4 images with true CFG is 705. CPU serves the embedded model (a full-size one is impractical there):
# 512x512 x 30 steps with true CFG is 16.
DEVICE_LIMITS: dict[str, tuple[float, float]] = {"cuda": (1000.0, 300.0), "cpu": (32.0, 120.0)}


# An Edit model sees each input image at about this many pixels (diffusers' fixed 1024x1024 VAE area): its
# latents join the target's tokens at every step, so an edit costs as if its output were that much larger.
EDIT_INPUT_PIXELS = 1024 * 1024


def work_of(
    width: int, height: int, steps: int, images: int, true_cfg: bool, inputs: int = 0, frames: int = 1
) -> float:
    """A request's cost in megapixel-steps (true CFG runs the transformer twice per step); `inputs` input
    images of an edit add their pixels to the output's; a Layered request denoises `frames` (its layers and
    the whole image) at the output's size."""
    pixels = width * height * frames + inputs * EDIT_INPUT_PIXELS
    return pixels / 1e6 * steps * images * (2 if true_cfg else 1)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may cost, how long it may run, how many may wait, how long images stay."""

    max_work: float  # megapixel-steps: width x height / 1e6 x steps x images, x2 with true CFG
    time_limit_s: float  # a running request is stopped after this long (its queue wait not counted)
    queue_size: int = 64  # requests waiting at once; more are refused with "queue full"
    jobs_per_client: int = 1  # requests one browser tab or API client may have waiting or running
    keep_images_minutes: float = 30  # generated images are deleted from the server after this long
    max_body_mb: float = 1.0  # the HTTP server's largest JSON request body
    max_upload_mb: float = 32.0  # the HTTP server's largest multipart request (input images of an edit)
    cache_mb: float = 256.0  # images the HTTP server keeps for URL responses; the oldest go first

    def __post_init__(self) -> None:
        for name in (
            "max_work",
            "time_limit_s",
            "keep_images_minutes",
            "max_body_mb",
            "max_upload_mb",
            "cache_mb",
        ):
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value > 0):
                raise InputError(f"{name} {value!r} must be a positive number")
        for name in ("queue_size", "jobs_per_client"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} {value!r} must be a whole number >= 1")

    @classmethod
    def for_device(cls, device_type: str, **overrides: Any) -> "Limits":
        """DEVICE_LIMITS for `device_type` ("cuda", "cpu", ...; others as CPU), then non-None overrides."""
        max_work, time_limit_s = DEVICE_LIMITS.get(device_type, DEVICE_LIMITS["cpu"])
        chosen = {name: value for name, value in overrides.items() if value is not None}
        return cls(**({"max_work": max_work, "time_limit_s": time_limit_s} | chosen))

    def describe(self) -> str:
        """The limits as one Markdown paragraph for the page."""
        example = work_of(1328, 1328, 50, 1, true_cfg=True)
        return (
            f"**Limits:** at most **{self.max_work:g} megapixel-steps** per request (width × height / 10⁶ "
            f"× steps × images, ×2 with true CFG: 1328×1328 at 50 steps with CFG is {example:.0f}) and "
            f"**{self.time_limit_s:g} s** of running time; {self.queue_size} requests may wait, "
            f"{self.jobs_per_client} per browser tab or API client. Images are deleted from the server "
            f"after {self.keep_images_minutes:g} min."
        )
