"""Gradio-free core of the demo: presets, request checks (values and cost), and the runner that runs jobs.

Kept apart from the layout so it can be unit-tested with a fake pipeline and no server.
"""

import math
import random
import threading
import time
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any, Protocol

from PIL import Image

from models.errors import InputError
from models.family import DEFAULT_SEQUENCE_LENGTH
from pipelines.images import MAX_INPUT_BYTES, open_input_image
from pipelines.limits import check_generation_args
from ui.limits import Limits, work_of

CUSTOM = "custom"
RANDOM_SEED = -1  # the seed field's value (and the API default) for "draw a random seed"
# DESIGN §2: Qwen-Image's official aspect presets, (width, height).
ASPECT_RATIOS: dict[str, tuple[int, int]] = {
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
STAGES = ("text_encoding", "image_encoding", "denoising", "decoding", "total")
MAX_IMAGES_PER_REQUEST = 4  # per request: what the gallery shows at once
MAX_PROMPT_CHARS = 20_000  # far beyond the 512 tokens the text encoder keeps; bounds tokenizer work
# The /generate API's parameters in order: the page's inputs.
INPUT_NAMES = (
    "prompt",
    "negative_prompt",
    "aspect",
    "width",
    "height",
    "num_inference_steps",
    "true_cfg_scale",
    "seed",
    "randomize_seed",
    "num_images",
    "variant",
)


class Pipeline(Protocol):
    """The part of docs/API.md's pipeline object that the UI uses."""

    variant: str
    model_name: str
    device: Any
    size_multiple: int  # what image sides must be multiples of
    defaults: Any  # GenerationDefaults
    last_run: Any  # RunInfo

    def available_variants(self) -> list[str]: ...

    def set_variant(self, variant: str) -> None: ...

    def parallel_summary(self) -> str: ...

    def generate(self, prompt: str, **kwargs: Any) -> list[Image.Image]: ...

    def default_size(self, images: list[Image.Image]) -> tuple[int, int]:
        """The output size for these input images (the Edit tab also reads `spec.max_images`)."""
        ...


class FieldError(InputError):
    """A request value is invalid; `field` names the input (one of INPUT_NAMES) it concerns."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# Why a job stopped (Job.stop_reason); the time limit's reason names the limit.
STOP_PRESSED = "Stop was pressed"
CANCELLED = "the client cancelled the request"
DISCONNECTED = "the page was closed or the client disconnected"


class Stopped(Exception):
    """Raised from the step callback when a job's stop flag is set; the pipeline aborts on it."""

    def __init__(self, job: "Job") -> None:
        self.reason = job.stop_reason
        super().__init__(stop_message(job, self.reason))

    @property
    def by_user(self) -> bool:
        return self.reason == STOP_PRESSED


def stop_message(job: "Job", reason: str | None) -> str:
    """Where the job stopped, with the reason unless it was the user's own Stop."""
    tail = "." if reason in (None, STOP_PRESSED) else f": {reason}."
    return f"Stopped after {job.steps_done} of {job.total_steps} steps{tail}"


class Job:
    """One request: its client session, variant and `generate` kwargs, its own stop flag and step count."""

    def __init__(self, session: str | None, variant: str, kwargs: dict[str, Any]) -> None:
        self.session = session
        self.variant = variant
        self.kwargs = kwargs
        self.ignored_seed: int | None = None  # a seed given with randomize_seed on (reported, not used)
        self.steps_done = 0
        self.stop_reason: str | None = None
        self.stopped = False  # it ended on its stop flag
        self.finished = threading.Event()  # set when the runner is done with it, however it ended

    @property
    def total_steps(self) -> int:
        return self.kwargs["num_inference_steps"]

    @property
    def true_cfg(self) -> bool:
        """Whether the pipeline runs true CFG for it (a negative prompt and a scale above 1)."""
        return self.kwargs["negative_prompt"] is not None and self.kwargs["true_cfg_scale"] > 1

    @property
    def work(self) -> float:
        k = self.kwargs
        inputs = len(k.get("image") or ())
        return work_of(
            k["width"], k["height"], self.total_steps, k["num_images_per_prompt"], self.true_cfg, inputs
        )

    def stop(self, reason: str) -> None:
        """Ask the job to stop after its current step (or before it starts); the first reason stays."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def raise_if_stopped(self) -> None:
        if self.stop_reason is not None:
            self.stopped = True
            raise Stopped(self)


class Runner:
    """Runs one job at a time on the process's single pipeline: the one place a generation runs.

    Each job carries its own stop flag, checked after every denoising step, so Stop, a cancelled or
    disconnected client and the time limit all end it within one step; the lock keeps a stopping job
    from overlapping the next one.
    """

    def __init__(self, pipe: Pipeline, time_limit_s: float) -> None:
        self._pipe = pipe
        self._time_limit_s = time_limit_s
        self._device_lock = threading.Lock()
        self._jobs_lock = threading.Lock()
        self._jobs: list[Job] = []  # waiting for the device or running

    def jobs(self) -> list[Job]:
        """Jobs waiting for the device or running now (empty when the server is idle)."""
        with self._jobs_lock:
            return list(self._jobs)

    def stop_session(self, session: str | None, reason: str) -> list[Job]:
        """Stop every job of `session`; returns them (empty when it has none)."""
        jobs = [job for job in self.jobs() if job.session == session]
        for job in jobs:
            job.stop(reason)
        return jobs

    def run(self, job: Job, on_step: Callable[[int, int], None]) -> tuple[list[Image.Image], Any]:
        """Generate `job` (switching the variant in place on the same weights); returns (images, RunInfo)."""
        with self._jobs_lock:
            self._jobs.append(job)
        try:
            with self._device_lock:
                job.raise_if_stopped()
                deadline = time.monotonic() + self._time_limit_s

                def step(i: int, total: int) -> None:
                    job.steps_done = i
                    if time.monotonic() > deadline:
                        job.stop(f"this server stops a request after {self._time_limit_s:g} s")
                    job.raise_if_stopped()
                    on_step(i, total)

                if job.variant != self._pipe.variant:
                    self._pipe.set_variant(job.variant)
                images = self._pipe.generate(on_step=step, **job.kwargs)
                return images, self._pipe.last_run
        finally:
            with self._jobs_lock:
                self._jobs.remove(job)
            job.finished.set()


def job_from_inputs(
    session: str | None, values: Mapping[str, Any], variants: Sequence[str], size_multiple: int
) -> Job:
    """Check every value of a /generate request (from the page or any API client) and build its Job.

    Raw JSON values arrive here (NaN, infinity, strings in number fields...); each bad one raises a
    FieldError naming its input. Ranges are the pipeline's own checks.
    """
    prompt = _text("prompt", values["prompt"])
    negative_prompt = _text("negative_prompt", values["negative_prompt"]) or None
    aspect = values["aspect"]
    if aspect in ASPECT_RATIOS:
        width, height = ASPECT_RATIOS[aspect]
    elif aspect == CUSTOM:
        width, height = _whole("width", values["width"]), _whole("height", values["height"])
    else:
        choices = ", ".join([*ASPECT_RATIOS, CUSTOM])
        raise FieldError("aspect", f"aspect {aspect!r} must be one of {choices}")
    steps = _whole("num_inference_steps", values["num_inference_steps"])
    true_cfg_scale = _number("true_cfg_scale", values["true_cfg_scale"])
    randomize = _flag("randomize_seed", values["randomize_seed"])
    given = None if values["seed"] in (None, RANDOM_SEED) else _whole("seed", values["seed"])
    seed = _random_seed() if randomize or given is None else given
    images = _whole("num_images", values["num_images"])
    if not 1 <= images <= MAX_IMAGES_PER_REQUEST:
        raise FieldError("num_images", f"num_images {images} must be between 1 and {MAX_IMAGES_PER_REQUEST}")
    variant = values["variant"]
    if variant not in variants:
        raise FieldError("variant", f"variant {variant!r} is not served here: choose {', '.join(variants)}")
    negatives = None if negative_prompt is None else [negative_prompt]
    try:
        check_generation_args(
            [prompt],
            negatives,
            width,
            height,
            steps,
            true_cfg_scale,
            images,
            DEFAULT_SEQUENCE_LENGTH,
            seed,
            size_multiple,
        )
    except InputError as err:
        name = str(err).split()[0]
        field = "num_images" if name == "num_images_per_prompt" else name
        raise FieldError(field if field in INPUT_NAMES else "prompt", str(err)) from None
    kwargs = {
        "prompt": prompt,
        "negative_prompt": negative_prompt,
        "width": width,
        "height": height,
        "num_inference_steps": steps,
        "true_cfg_scale": true_cfg_scale,
        "seed": seed,
        "num_images_per_prompt": images,
    }
    job = Job(session, variant, kwargs)
    job.ignored_seed = given if randomize and given is not None else None
    return job


FROM_IMAGES = "from the images"  # the edit form's size choice: what the input images suggest
# The /edit API's parameters besides the input images (`image_1` ... `image_N`, N the images the model
# takes): /generate's, with the size choice in the place of the aspect ratio.
EDIT_INPUT_NAMES = tuple("size" if name == "aspect" else name for name in INPUT_NAMES)


def image_input_names(max_images: int) -> tuple[str, ...]:
    """The edit form's image inputs: one per image the model takes (Picture 1, 2, ...)."""
    return tuple(f"image_{i}" for i in range(1, max_images + 1))


def job_from_edit_inputs(
    session: str | None,
    values: Mapping[str, Any],
    variants: Sequence[str],
    pipe: Any,
    uploaded: Container[str],
) -> Job:
    """Check an /edit request (from the page or any API client) and build its Job: the images are files
    this server received through its upload route (`uploaded`), each opened and checked (an image, not
    truncated, within the byte and pixel caps); the size is what they suggest (`pipe.default_size`) or
    custom; every other value as for /generate."""
    names = image_input_names(pipe.spec.max_images)
    images = [_uploaded_image(name, values[name], uploaded) for name in names if values[name] is not None]
    if not images:
        raise FieldError(names[0], "give an input image to edit")
    size = values["size"]
    if size not in (FROM_IMAGES, CUSTOM):
        raise FieldError("size", f"size {size!r} must be {FROM_IMAGES!r} or {CUSTOM!r}")
    sides = (
        dict(zip(("width", "height"), pipe.default_size(images), strict=True)) if size == FROM_IMAGES else {}
    )
    job = job_from_inputs(session, {**values, "aspect": CUSTOM, **sides}, variants, pipe.size_multiple)
    job.kwargs["image"] = images
    return job


def _uploaded_image(name: str, value: Any, uploaded: Container[str]) -> Image.Image:
    """The image of one raw image input: Gradio's file data of an upload to this server, decoded."""
    path = value.get("path") if isinstance(value, dict) else None
    if not isinstance(path, str) or path not in uploaded:
        raise FieldError(name, f"{name} must be an image uploaded to this server")
    try:
        return open_input_image(path, MAX_INPUT_BYTES)
    except InputError as err:
        raise FieldError(name, str(err).replace(f"input image {path}", name)) from None


def check_work(job: Job, limits: Limits) -> None:
    """FieldError when the job costs more than the server allows per request (shown at the prompt)."""
    if job.work <= limits.max_work:
        return
    k = job.kwargs
    inputs = len(k.get("image") or ())
    pixels = f"width {k['width']} × height {k['height']}"
    if inputs:  # an Edit model sees each input image at about 1024x1024 (ui/limits.py)
        pixels = f"({pixels} + {inputs} input image{'s' * (inputs > 1)} × 1024 × 1024)"
    size = f"{pixels} / 10⁶ × num_inference_steps {job.total_steps} × num_images {k['num_images_per_prompt']}"
    cfg = " × 2 for true CFG (negative_prompt with true_cfg_scale > 1)" if job.true_cfg else ""
    raise FieldError(
        "num_inference_steps",
        f"This request is {job.work:.4g} megapixel-steps ({size}{cfg}); this server allows at most "
        f"{limits.max_work:g} per request: lower num_inference_steps, num_images, width or height.",
    )


def preset_for(width: int, height: int) -> str:
    """The preset with exactly this size, else "custom"."""
    return next((name for name, size in ASPECT_RATIOS.items() if size == (width, height)), CUSTOM)


def _random_seed() -> int:
    """Picked here rather than by the pipeline so that a stopped request can still report its seed."""
    return random.randrange(2**31)


def _text(field: str, value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FieldError(field, f"{field} must be text, not {type(value).__name__}")
    if len(value) > MAX_PROMPT_CHARS:
        raise FieldError(field, f"{field} has {len(value)} characters: at most {MAX_PROMPT_CHARS}")
    return value


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(field, f"{field} must be a number, not {value!r}")
    if not math.isfinite(value):
        raise FieldError(field, f"{field} must be a finite number, not {value}")
    return value


def _whole(field: str, value: Any) -> int:
    number = _number(field, value)
    if number != int(number):
        raise FieldError(field, f"{field} {number} must be a whole number")
    return int(number)


def _flag(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FieldError(field, f"{field} must be true or false, not {value!r}")
    return value


def seed_note(job: Job) -> str:
    """A line for the details when a given seed was not used because randomize_seed was on ('' else)."""
    if job.ignored_seed is None:
        return ""
    return (
        f"**Note:** seed {job.ignored_seed} was not used: randomize_seed is on (pass randomize_seed=False "
        f"to use it); this run's seed is `{job.kwargs['seed']}`.\n\n"
    )


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
