"""Gradio-free core of the demo: aspect presets, the one-at-a-time runner, and the run details text.

Kept apart from the layout so it can be unit-tested with a fake pipeline and no server.
"""

import threading
from collections.abc import Callable
from typing import Any, Protocol

from PIL import Image

CUSTOM = "custom"
# DESIGN §2: Qwen-Image's official aspect presets, (width, height).
PRESETS: dict[str, tuple[int, int]] = {
    "1:1": (1328, 1328),
    "16:9": (1664, 928),
    "9:16": (928, 1664),
    "4:3": (1472, 1104),
    "3:4": (1104, 1472),
    "3:2": (1584, 1056),
    "2:3": (1056, 1584),
}
VARIANT_LABELS = {
    "fp8-fused": "FP8 fused",
    "fp8-unfused": "FP8 unfused",
    "contract": "BF16",
    "reference": "BF16 (diffusers reference)",
}
STAGES = ("text_encoding", "denoising", "decoding", "total")


class Pipeline(Protocol):
    """The part of docs/API.md's pipeline object that the UI uses."""

    variant: str
    model_name: str
    device: Any
    defaults: Any  # GenerationDefaults
    last_run: Any  # RunInfo

    def available_variants(self) -> list[str]: ...

    def set_variant(self, variant: str) -> None: ...

    def generate(self, prompt: str, **kwargs: Any) -> list[Image.Image]: ...


class Cancelled(Exception):
    """Raised from the step callback when the user pressed Stop; the pipeline aborts on it."""


def resolve_size(aspect: str, width: float | None, height: float | None) -> tuple[int | None, int | None]:
    """(width, height) for a preset name, else the custom fields (the pipeline validates them)."""
    if aspect in PRESETS:
        return PRESETS[aspect]
    return _as_int(width), _as_int(height)


def preset_for(width: int, height: int) -> str:
    """The preset with exactly this size, else "custom"."""
    return next((name for name, size in PRESETS.items() if size == (width, height)), CUSTOM)


def _as_int(value: float | None) -> int | None:
    return None if value is None else round(value)


class Runner:
    """Runs one generation at a time (one GPU) on the process's single pipeline.

    Gradio's cancel only abandons the request; the worker thread keeps going. So Stop also sets a
    flag for the session's job (running, or waiting for the GPU), and the step callback raises
    `Cancelled` on it. The lock keeps a cancelled-but-still-running job from overlapping the next one.
    """

    def __init__(self, pipe: Pipeline) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()
        self._stops: dict[str, threading.Event] = {}  # session -> its latest job's stop flag

    def stop(self, session: str) -> bool:
        """Ask the job of `session` to stop at its next step; False when it has none."""
        stopped = self._stops.get(session)
        if stopped is not None:
            stopped.set()
        return stopped is not None

    def run(
        self, session: str, variant: str, on_step: Callable[[int, int], None], **kwargs: Any
    ) -> tuple[list[Image.Image], Any]:
        """Generate with `variant` (switched in place on the same weights); returns (images, RunInfo)."""
        stopped = self._stops[session] = threading.Event()

        def step(i: int, total: int) -> None:
            if stopped.is_set():
                raise Cancelled("stopped by the user")
            on_step(i, total)

        try:
            with self._lock:
                if stopped.is_set():
                    raise Cancelled("stopped by the user")
                if variant != self._pipe.variant:
                    self._pipe.set_variant(variant)
                images = self._pipe.generate(on_step=step, **kwargs)
                return images, self._pipe.last_run
        finally:
            if self._stops.get(session) is stopped:
                del self._stops[session]


def format_details(run: Any) -> str:
    """Markdown for the details panel: seed, size, variant, time per stage, ms per step, fused paths."""
    rows = "\n".join(
        f"| {stage.replace('_', ' ')} | {run.timings[stage]:.3f} s |"
        for stage in STAGES
        if stage in run.timings
    )
    return (
        f"**Seed:** `{run.seed}`  \n"
        f"**Size:** {run.width}×{run.height}, {run.num_inference_steps} steps, "
        f"**{run.ms_per_step:.1f} ms/step**  \n"
        f"**Variant:** {VARIANT_LABELS.get(run.variant, run.variant)} (`{run.variant}`)  \n"
        f"**Fused paths:** {run.fusion_summary}\n\n"
        f"| stage | time |\n|---|---|\n{rows}\n"
    )
