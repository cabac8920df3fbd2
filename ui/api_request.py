"""The HTTP API's request parsing: an OpenAI Images API request (JSON, or multipart for edits) into a Job with
the pipeline's `GenerationRequest`, or one ApiError in OpenAI's shape naming the parameter. The fields each
route takes are the request options declared for it (pipelines/options.py) plus OpenAI's own; each value is
read by its declared kind, then resolved and checked by `pipe.request` (pipelines/generation_request.py),
as for the CLI and the demo, and an error's option is named by its field here."""

import base64
import binascii
import io
import json
import re
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import PIL.Image
from fastapi.responses import JSONResponse

from qwen_image_fusion.pipelines.limits import MAX_INPUT_PIXELS
from qwen_image_fusion.pipelines.options import (
    CHOICE,
    EDITS,
    FLAG,
    GENERATIONS,
    IMAGE,
    IMAGES,
    NUMBER,
    OPTION,
    REQUIRED,
    TEXT,
    WHOLE,
    Option,
    http_options,
    number_text,
)
from qwen_image_fusion.ui.generation import (
    FieldError,
    check_work,
    number_field,
    random_seed,
    request_of,
    text_field,
    whole_field,
)
from qwen_image_fusion.ui.image_cache import LOSSY, MEDIA_TYPES, Encoding
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.runner import Job

Start = tuple[PIL.Image.Image, PIL.Image.Image | None]  # img2img's image and inpainting's mask
MAX_INPUT_IMAGES = 16  # files one edit request may carry (the model's own bound is checked too)
RESPONSE_FORMATS = ("b64_json", "url")
SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
OPENAI_FIELDS = ("model", "response_format", "output_format", "output_compression")  # the response's
IGNORED = ("user", "quality", "style", "moderation")  # OpenAI fields that change nothing here
# Fields read apart from their declared kind: the size (width and height), the count, LoRA scales, uploads.
SPECIAL = {"width", "height", "num_images_per_prompt", "lora_scales", "image", "init_image", "mask_image"}


def route_fields(route: str) -> tuple[str, ...]:
    """Every field `route` takes: its request options' (declared), OpenAI's own, and an edit's `image[]`."""
    declared = dict.fromkeys(field for _, field in http_options(route))
    return (*declared, *OPENAI_FIELDS, *IGNORED, *(("image[]",) if route == EDITS else ()))


FIELDS, EDIT_FIELDS = route_fields(GENERATIONS), route_fields(EDITS)


class ApiError(Exception):
    """An error answered in OpenAI's shape: `status`, message, the parameter it concerns, a code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, self.status, headers=self.headers)


def run_metadata(run: Any) -> dict[str, Any]:
    """What ran, as a response's `run` field (an extension OpenAI clients ignore): the variant, the steps,
    seconds per stage, and the approximate paths as their stages recorded them (`cache`, `decode`; null
    when none ran)."""
    return {
        "variant": run.variant,
        "num_inference_steps": run.num_inference_steps,
        "timings": dict(run.timings),
        "cache": None if run.cache is None else asdict(run.cache),
        "decode": None if run.decode is None else asdict(run.decode),
    }


def model_id(pipe: Any) -> str:
    """The id /v1/models lists: the checkpoint directory's name (or the embedded default's)."""
    return Path(pipe.model_name).name or pipe.model_name


def read_job(
    values: Mapping[str, Any],
    pipe: Any,
    limits: Limits,
    variant: str,
    images: list | None = None,
    start: Start | None = None,
    mask: PIL.Image.Image | None = None,
) -> tuple[Job, str, Encoding]:
    """Parse every value of an Images API request into its Job on `variant` (the request fully resolved:
    size, steps, CFG scale, negative prompt, seed and every loaded LoRA's scale, so no earlier request's
    state reaches it), its response format and its images' Encoding; ApiError (400) names the first bad
    one. Multipart values arrive as text; a number field's text is read as a number. An edit brings input
    `images` (an edit model's, with the `mask` of an inpainting edit) or the image to `start` from and its
    mask (a text-to-image model's img2img and inpainting)."""
    route = EDITS if images is not None or start is not None else GENERATIONS
    unknown = sorted(set(values) - set(route_fields(route)))
    if unknown:
        raise ApiError(400, f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
    try:
        return _job_of(values, pipe, limits, variant, route, images, start, mask)
    except FieldError as err:
        raise ApiError(400, str(err), err.field, "invalid_value") from None


def _job_of(
    values: Mapping[str, Any],
    pipe: Any,
    limits: Limits,
    variant: str,
    route: str,
    images: list | None,
    start: Start | None,
    mask: PIL.Image.Image | None,
) -> tuple[Job, str, Encoding]:
    text_numbers = route == EDITS  # multipart: every value is text
    served = values.get("model")
    if served is not None and served not in (model_id(pipe), pipe.model_name):
        raise FieldError(
            "model", f"model {served!r} is not served here: this server serves {model_id(pipe)!r}"
        )
    response_format = values.get("response_format") or "b64_json"
    if response_format not in RESPONSE_FORMATS:
        raise FieldError("response_format", f"response_format {response_format!r} must be b64_json or url")
    compression = _number(values.get("output_compression"), "output_compression", WHOLE, text_numbers)
    encoding = _encoding(values.get("output_format"), compression)
    for name in IGNORED:
        if values.get(name) is not None and not isinstance(values[name], str):
            raise FieldError(name, f"{name} must be text, not {values[name]!r}")
    request_values = {
        option.name: _field_value(option, field, values.get(field), text_numbers)
        for option, field in http_options(route)
        if option.name not in SPECIAL
    }
    n = _field_value(OPTION["num_images_per_prompt"], "n", values.get("n"), text_numbers)
    low, high = OPTION["num_images_per_prompt"].served_bounds
    if not low <= n <= high:
        raise FieldError("n", f"n {n} must be between {number_text(low)} and {number_text(high)}")
    width, height = _size(values.get("size"))
    request_values |= {
        "width": width,
        "height": height,
        "num_images_per_prompt": n,
        "seed": random_seed() if request_values["seed"] is None else request_values["seed"],
        "lora_scales": _lora_scales(values.get("lora_scales"), getattr(pipe, "loras", {}), text_numbers),
        "image": images or None,
        "init_image": None if start is None else start[0],
        "mask_image": mask if start is None else start[1],
    }
    prompt = request_values.pop("prompt")
    names = {option.name: field for option, field in http_options(route)}
    request = request_of(pipe, names, prompt, **request_values)
    job = Job(None, variant, request)
    check_work(job, limits)
    return job, response_format, encoding


def _field_value(option: Option, field: str, value: Any, text_numbers: bool) -> Any:
    """A field's raw value read as its option's kind (absent: the option's `generate()` default); the
    pipeline checks the range."""
    if value is None:
        return "" if option.default is REQUIRED else option.given_default
    if option.kind == TEXT:
        return text_field(field, value)
    if option.kind in (WHOLE, NUMBER):
        return _number(value, field, option.kind, text_numbers)
    if option.kind == FLAG:
        return _flag(value, field)
    if option.kind == CHOICE and not isinstance(value, str):
        raise FieldError(field, f"{field} must be text, not {value!r}")
    if option.kind == CHOICE and not value:
        return option.given_default
    if option.kind == IMAGES:
        return _images(value, field)
    if option.kind == IMAGE:
        return _one_image(value, field)
    return value  # a choice's text, a list of numbers: the pipeline checks them


def _number(value: Any, field: str, kind: str, text_numbers: bool) -> Any:
    """A number field (None stays None): a finite number, whole for a WHOLE kind; multipart text is read
    as a number first."""
    if value is None:
        return None
    if text_numbers and isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eEnN") else int(value)
        except ValueError:
            raise FieldError(field, f"{field} must be a number, not {value!r}") from None
    return whole_field(field, value) if kind == WHOLE else number_field(field, value)


def _encoding(output_format: Any, compression: int | None) -> Encoding:
    """The images' Encoding from OpenAI's `output_format` (default png) and `output_compression` (0-100, for
    the lossy formats only; default 100)."""
    output_format = output_format or "png"
    if not isinstance(output_format, str) or output_format not in MEDIA_TYPES:
        raise FieldError("output_format", f"output_format {output_format!r} must be png, jpeg or webp")
    if compression is None:
        return Encoding(output_format)
    if output_format not in LOSSY:
        raise FieldError(
            "output_compression",
            f"output_compression applies to jpeg and webp only, not {output_format} (lossless)",
        )
    if not 0 <= compression <= 100:
        raise FieldError("output_compression", f"output_compression {compression} must be between 0 and 100")
    return Encoding(output_format, compression)


def _flag(value: Any, name: str) -> bool:
    """A boolean field: JSON true/false, or the text "true"/"false" of a multipart form (absent: false)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if value in ("true", "false"):
        return value == "true"
    raise FieldError(name, f"{name} must be true or false, not {value!r}")


def _images(value: Any, param: str) -> list[PIL.Image.Image]:
    """An extension field holding one base64 image (a data URL too) or a list of them."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(item, str) for item in items):
        raise FieldError(param, f"{param} must be a base64 image or a list of them")
    what = param.replace("_", " ")
    return [_base64_image(item, f"{what} {i}", param) for i, item in enumerate(items, 1)]


def _one_image(value: Any, param: str) -> PIL.Image.Image:
    """An extension field holding one base64 image."""
    if not isinstance(value, str):
        raise FieldError(param, f"{param} must be a base64 image")
    return _base64_image(value, param, param)


def _base64_image(text: str, name: str, param: str) -> PIL.Image.Image:
    """A base64 image (a `data:` URL too) decoded and read; FieldError or ApiError naming `param`."""
    try:
        encoded = text.split(",", 1)[1] if text.startswith("data:") else text
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, IndexError):
        raise FieldError(param, f"{name} is not base64") from None
    return read_image(data, name, param)


def _size(value: Any) -> tuple[int | None, int | None]:
    """(width, height) of a `size` "WxH"; "auto" or none: (None, None), the model's default (for an edit,
    the size the model picks for its input images)."""
    if value in (None, "auto"):
        return None, None
    match = SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise FieldError("size", f"size {value!r} must be WIDTHxHEIGHT in pixels, such as 1024x1024, or auto")
    return int(match[1]), int(match[2])


def _lora_scales(value: Any, loaded: Mapping[str, Any], text: bool) -> dict[str, float]:
    """{LoRA name: scale} for every LoRA the server has loaded: those the request names (multipart: as JSON
    text) at its scales, the others at 0 (off). The pipeline checks the names and the scales."""
    off = dict.fromkeys(loaded, 0.0)
    if value is None:
        return off
    if text and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise FieldError("lora_scales", "lora_scales must be a JSON object of {name: scale}") from None
    if not isinstance(value, dict):
        raise FieldError("lora_scales", "lora_scales must be an object of {LoRA name: scale}")
    return off | value


def openai_mask(mask: PIL.Image.Image) -> PIL.Image.Image:
    """An Images API mask as the pipeline reads one (white: repaint): with an alpha channel, OpenAI's rule
    (the fully transparent pixels are edited); without one, diffusers' (white pixels are repainted)."""
    if "A" not in mask.getbands():
        return mask
    return mask.getchannel("A").point(lambda alpha: 255 if alpha == 0 else 0)


def read_image(data: bytes, name: str, param: str = "image") -> PIL.Image.Image:
    """An uploaded file (`name` in messages, for the API parameter `param`) as a loaded PIL image; ApiError
    (400) when it is not an image PIL reads or has more than MAX_INPUT_PIXELS pixels (checked from its
    header, before its pixels are decoded)."""
    try:
        image = PIL.Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_INPUT_PIXELS:
            raise ApiError(
                400,
                f"{name} is {image.width}x{image.height}: at most {MAX_INPUT_PIXELS / 1e6:.1f} MP",
                param,
                "image_too_large",
            )
        image.load()
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as err:
        raise ApiError(400, f"{name} is not an image this server reads ({err})", param) from None
    return image
