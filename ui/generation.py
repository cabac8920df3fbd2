"""Gradio-free core of the demo: presets and request checks (values and cost); ui/runner.py runs the jobs.

Kept apart from the layout so it can be unit-tested with a fake pipeline and no server. The field checks
(`text_field`, `number_field`, ...) serve the HTTP server's requests too (ui/server.py).
"""

import math
import random
from collections.abc import Container, Mapping
from typing import Any, Protocol

from PIL import Image

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines.generation_request import GenerationRequest
from qwen_image_fusion.pipelines.images import MAX_INPUT_BYTES, open_input_image
from qwen_image_fusion.pipelines.options import (
    DEFAULT_LAYERS,
    DEFAULT_STRENGTH,
    OPTION,
    OPTIONS,
    front_end_name,
)
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.runner import Job

CUSTOM = "custom"
FROM_IMAGES = "from the images"  # the edit form's size choice: what the input images suggest
# What the Image-to-image tab does with its image on a ControlNet checkpoint: start from it, guide by it as a
# control map, or guide by its canny edges (made here)
IMAGE_ROLES = {"start": None, "control map": None, "canny edges": "canny"}
RANDOM_SEED = -1  # the seed field's value (and the API default) for "draw a random seed"
NO_CROP = -1  # the padding_mask_crop field's value (and the API default) for "generate the whole image"
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
    "nvfp4": "NVFP4 weights (4-bit)",
    "nvfp4-w4a4-fused": "NVFP4 W4A4 fused (Blackwell)",
    "nvfp4-w4a4-unfused": "NVFP4 W4A4 unfused (Blackwell)",
    "contract": "BF16",
    "reference": "BF16 (diffusers reference)",
}
STAGES = ("text_encoding", "image_encoding", "denoising", "decoding", "total")
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
# The request options' demo inputs, as declared (pipelines/options.py): an error's option names its input.
DEMO_FIELDS = {option.name: option.demo for option in OPTIONS if option.demo}


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

    def request(self, prompt: str, **values: Any) -> GenerationRequest:
        """The resolved request (the Edit tab also reads `spec.max_images`)."""
        ...

    def run(self, requests: list[Any], slots: int | None = None, on_step: Any = None) -> list[Any]: ...


class FieldError(InputError):
    """A request value is invalid; `field` names the input (one of INPUT_NAMES) it concerns."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def job_from_inputs(
    session: str | None, values: Mapping[str, Any], pipe: Any, extra: Mapping[str, Any] | None = None
) -> Job:
    """Check every value of a /generate request (from the page or any API client) and build its Job with
    the pipeline's request (`pipe.request`); `extra`: further `generate()` arguments (the preset and LoRA
    controls', an edit's images).

    Raw JSON values arrive here (NaN, infinity, strings in number fields...); each bad one raises a
    FieldError naming its input. Ranges are the pipeline's own checks.
    """
    prompt = text_field("prompt", values["prompt"])
    negative_prompt = text_field("negative_prompt", values["negative_prompt"]) or None
    aspect = values["aspect"]
    presets = aspect_ratios(pipe.size_multiple)
    if aspect in presets:
        width, height = presets[aspect]
    elif aspect == FROM_IMAGES and extra and (extra.get("image") or extra.get("init_image")):
        width = height = None  # the size the input images suggest (the pipeline's)
    elif aspect == CUSTOM:
        width, height = whole_field("width", values["width"]), whole_field("height", values["height"])
    else:
        choices = ", ".join([*presets, CUSTOM])
        raise FieldError("aspect", f"aspect {aspect!r} must be one of {choices}")
    steps = whole_field("num_inference_steps", values["num_inference_steps"])
    true_cfg_scale = number_field("true_cfg_scale", values["true_cfg_scale"])
    randomize = flag_field("randomize_seed", values["randomize_seed"])
    given = None if values["seed"] in (None, RANDOM_SEED) else whole_field("seed", values["seed"])
    seed = random_seed() if randomize or given is None else given
    images = whole_field("num_images", values["num_images"])
    low, high = OPTION["num_images_per_prompt"].served_bounds
    if not low <= images <= high:
        raise FieldError("num_images", f"num_images {images} must be between {low:g} and {high:g}")
    variants = pipe.available_variants()
    variant = values["variant"]
    if variant not in variants:
        raise FieldError("variant", f"variant {variant!r} is not served here: choose {', '.join(variants)}")
    request = request_of(
        pipe,
        DEMO_FIELDS,
        prompt,
        negative_prompt=negative_prompt,
        width=width,
        height=height,
        num_inference_steps=steps,
        true_cfg_scale=true_cfg_scale,
        seed=seed,
        num_images_per_prompt=images,
        **(extra or {}),
    )
    job = Job(session, variant, request)
    job.ignored_seed = given if randomize and given is not None else None
    return job


def request_of(pipe: Any, fields: Mapping[str, str], prompt: str, **values: Any) -> GenerationRequest:
    """`pipe.request(prompt, **values)`, the one resolution of a request; its InputError becomes a FieldError
    naming the front door's input for the option it concerns (`fields`: option name -> that input's name;
    an error of no one option, or of one this front door has no input for, concerns the prompt)."""
    try:
        return pipe.request(prompt, **values)
    except FieldError:
        raise
    except InputError as err:
        raise FieldError(front_end_name(err.field, fields, "prompt"), str(err)) from None


# The /edit API's parameters besides the input images (`image_1` ... `image_N`, N the images the model
# takes): /generate's, with the size choice in the place of the aspect ratio.
EDIT_INPUT_NAMES = tuple("size" if name == "aspect" else name for name in INPUT_NAMES)


def image_input_names(max_images: int) -> tuple[str, ...]:
    """The edit form's image inputs: one per image the model takes (Picture 1, 2, ...; a model that starts
    from an image: that one)."""
    return tuple(f"image_{i}" for i in range(1, max(max_images, 1) + 1))


def starts_from_image(pipe: Any) -> bool:
    """Whether the model reworks a start image (img2img, inpainting) rather than editing input images."""
    spec = getattr(pipe, "spec", None)
    return spec is not None and spec.max_images == 0 and getattr(spec, "starts_from_image", False)


def inpaints_input(pipe: Any) -> bool:
    """Whether the model repaints a mask's part of its input image (an inpainting edit)."""
    return getattr(getattr(pipe, "spec", None), "inpaints_input", False)


def job_from_edit_inputs(
    session: str | None,
    values: Mapping[str, Any],
    pipe: Any,
    uploaded: Container[str],
    extra: Mapping[str, Any] | None = None,
) -> Job:
    """Check an /edit request (from the page or any API client) and build its Job: the images are files
    this server received through its upload route (`uploaded`), each opened and checked (an image, not
    truncated, within the byte and pixel caps); the size is what they suggest (the pipeline's) or custom;
    every other value as for /generate."""
    names = image_input_names(pipe.spec.max_images)
    images = [_uploaded_image(name, values[name], uploaded) for name in names if values[name] is not None]
    if not images:
        raise FieldError(
            names[0], f"give an input image to {'start from' if starts_from_image(pipe) else 'edit'}"
        )
    size = values["size"]
    if size not in (FROM_IMAGES, CUSTOM):
        raise FieldError("size", f"size {size!r} must be {FROM_IMAGES!r} or {CUSTOM!r}")
    form = {**values, "aspect": size}
    mask = values.get("mask")
    crop = values.get("padding_mask_crop")
    crop = {"padding_mask_crop": None if crop in (None, NO_CROP) else whole_field("padding_mask_crop", crop)}
    if not starts_from_image(pipe):
        inpainting = {} if mask is None else _inpainting(values, mask, uploaded)
        if getattr(pipe.spec, "decomposes", False):
            inpainting["layers"] = whole_field("layers", values.get("layers", DEFAULT_LAYERS))
        return job_from_inputs(session, form, pipe, {**(extra or {}), "image": images, **inpainting, **crop})
    role = values.get("role", "start")
    if role not in IMAGE_ROLES or (role != "start" and not getattr(pipe.spec, "takes_control", False)):
        roles = ", ".join(IMAGE_ROLES) if getattr(pipe.spec, "takes_control", False) else "start"
        raise FieldError("role", f"role {role!r} must be one of: {roles}")
    if role != "start":
        inpaints = getattr(pipe.spec, "control_inpaints", False)
        if mask is not None and not inpaints:
            raise FieldError("mask", "a mask applies to a start image, not to a control map")
        control = {
            "control_image": images[0],
            "control_mode": IMAGE_ROLES[role],
            "controlnet_conditioning_scale": number_field("control_scale", values.get("control_scale", 1.0)),
            "control_mask": None if mask is None else _uploaded_image("mask", mask, uploaded),
        }
        return job_from_inputs(session, form, pipe, {**(extra or {}), **control, **crop})
    start = {"init_image": images[0], **_inpainting(values, mask, uploaded)}
    return job_from_inputs(session, form, pipe, {**(extra or {}), **start, **crop})


def _inpainting(values: Mapping[str, Any], mask: Any, uploaded: Container[str]) -> dict[str, Any]:
    """An /edit request's mask (an upload; None: none) and strength, as `generate()` arguments."""
    return {
        "mask_image": None if mask is None else _uploaded_image("mask", mask, uploaded),
        "strength": number_field("strength", values.get("strength", DEFAULT_STRENGTH)),
    }


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
    r = job.request
    inputs = len(r.images)
    pixels = f"width {r.width} × height {r.height}"
    if inputs:  # an Edit model sees each input image at about 1024x1024 (ui/limits.py)
        pixels = f"({pixels} + {inputs} input image{'s' * (inputs > 1)} × 1024 × 1024)"
    size = f"{pixels} / 10⁶ × num_inference_steps {job.total_steps} × num_images {r.num_images_per_prompt}"
    cfg = " × 2 for true CFG (negative_prompt with true_cfg_scale > 1)" if r.true_cfg else ""
    raise FieldError(
        "num_inference_steps",
        f"This request is {job.work:.4g} megapixel-steps ({size}{cfg}); this server allows at most "
        f"{limits.max_work:g} per request: lower num_inference_steps, num_images, width or height.",
    )


def aspect_ratios(size_multiple: int) -> dict[str, tuple[int, int]]:
    """The aspect presets for a model whose sides are multiples of `size_multiple`: each side floored to it,
    as diffusers floors a size (Qwen-Image's presets are multiples of 16; 2.1's sides of 32)."""
    return {name: (w // size_multiple * size_multiple, h // size_multiple * size_multiple)
            for name, (w, h) in ASPECT_RATIOS.items()}  # fmt: skip


def preset_for(width: int, height: int, size_multiple: int = 16) -> str:
    """The preset with exactly this size, else "custom"."""
    presets = aspect_ratios(size_multiple).items()
    return next((name for name, size in presets if size == (width, height)), CUSTOM)


def random_seed() -> int:
    """Picked here rather than by the pipeline so that a stopped request can still report its seed."""
    return random.randrange(2**31)


def text_field(field: str, value: Any) -> str:
    """A text value ('' for None), at most MAX_PROMPT_CHARS long; FieldError otherwise."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FieldError(field, f"{field} must be text, not {type(value).__name__}")
    if len(value) > MAX_PROMPT_CHARS:
        raise FieldError(field, f"{field} has {len(value)} characters: at most {MAX_PROMPT_CHARS}")
    return value


def number_field(field: str, value: Any) -> float:
    """A finite int or float (not a bool, not text); FieldError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(field, f"{field} must be a number, not {value!r}")
    if not math.isfinite(value):
        raise FieldError(field, f"{field} must be a finite number, not {value}")
    return value


def whole_field(field: str, value: Any) -> int:
    """A finite number with no fraction, as an int; FieldError otherwise."""
    number = number_field(field, value)
    if number != int(number):
        raise FieldError(field, f"{field} {number} must be a whole number")
    return int(number)


def flag_field(field: str, value: Any) -> bool:
    """True or false; FieldError otherwise."""
    if not isinstance(value, bool):
        raise FieldError(field, f"{field} must be true or false, not {value!r}")
    return value


def seed_note(job: Job) -> str:
    """A line for the details when a given seed was not used because randomize_seed was on ('' else)."""
    if job.ignored_seed is None:
        return ""
    return (
        f"**Note:** seed {job.ignored_seed} was not used: randomize_seed is on (pass randomize_seed=False "
        f"to use it); this run's seed is `{job.request.seed}`.\n\n"
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
