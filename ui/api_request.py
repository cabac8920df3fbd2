"""The HTTP API's request parsing: an OpenAI Images API request (JSON, or multipart for edits) into a Job with
the pipeline's `GenerationRequest`, or one ApiError in OpenAI's shape naming the parameter. Parsing only:
every value is resolved and checked by `pipe.request` (pipelines/generation_request.py), as for the CLI and
the demo."""

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
from qwen_image_fusion.ui.limits import MAX_IMAGES_PER_REQUEST, Limits
from qwen_image_fusion.ui.runner import Job

Start = tuple[PIL.Image.Image, PIL.Image.Image | None]  # img2img's image and inpainting's mask
MAX_INPUT_IMAGES = 16  # files one edit request may carry (the model's own bound is checked too)
RESPONSE_FORMATS = ("b64_json", "url")
SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
IGNORED = ("user", "quality", "style", "moderation")  # OpenAI fields that change nothing here
# extension fields of /v1/images/generations for a ControlNet checkpoint (JSON: maps as base64 strings)
CONTROL_FIELDS = (
    "control_image",
    "controlnet_conditioning_scale",
    "control_mode",
    "control_guidance_start",
    "control_guidance_end",
    "control_mask",
)
BASE_FIELDS = (
    "prompt",
    "model",
    "n",
    "size",
    "response_format",
    "output_format",
    "output_compression",
    "seed",
    "negative_prompt",
    "num_inference_steps",
    "true_cfg_scale",
    "preset",
    "lora_scales",
    "cache",
    "fast_decode",
    *IGNORED,
)
FIELDS = (*BASE_FIELDS, *CONTROL_FIELDS)
# extension fields of /v1/images/edits for a Qwen-Image-Layered checkpoint (each image's RGBA layers)
LAYER_FIELDS = ("layers", "resolution", "use_en_prompt")
EDIT_FIELDS = (*BASE_FIELDS, "image", "image[]", "mask", "strength", "padding_mask_crop", *LAYER_FIELDS)
# The pipeline's argument names and the API parameters they come from (an error names the parameter).
API_FIELDS = {name: name for name in (*EDIT_FIELDS, *CONTROL_FIELDS)} | {
    "width": "size",
    "height": "size",
    "num_images_per_prompt": "n",
    "init_image": "image",
    "mask_image": "mask",
}


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
    edit = images is not None or start is not None
    unknown = sorted(set(values) - set(EDIT_FIELDS if edit else FIELDS))
    if unknown:
        raise ApiError(400, f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
    try:
        return _job_of(values, pipe, limits, variant, images, start, mask, text_numbers=edit)
    except FieldError as err:
        raise ApiError(400, str(err), err.field, "invalid_value") from None


def _job_of(
    values: Mapping[str, Any],
    pipe: Any,
    limits: Limits,
    variant: str,
    images: list | None,
    start: Start | None,
    mask: PIL.Image.Image | None,
    text_numbers: bool,
) -> tuple[Job, str, Encoding]:
    def number(name: str, whole: bool) -> Any:
        value = values.get(name)
        if value is None:
            return None
        if text_numbers and isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eEnN") else int(value)
            except ValueError:
                raise FieldError(name, f"{name} must be a number, not {value!r}") from None
        return whole_field(name, value) if whole else number_field(name, value)

    served = values.get("model")
    if served is not None and served not in (model_id(pipe), pipe.model_name):
        raise FieldError(
            "model", f"model {served!r} is not served here: this server serves {model_id(pipe)!r}"
        )
    negative = values.get("negative_prompt")
    n = number("n", whole=True)
    n = 1 if n is None else n
    if not 1 <= n <= MAX_IMAGES_PER_REQUEST:
        raise FieldError("n", f"n {n} must be between 1 and {MAX_IMAGES_PER_REQUEST}")
    seed = number("seed", whole=True)
    response_format = values.get("response_format") or "b64_json"
    if response_format not in RESPONSE_FORMATS:
        raise FieldError("response_format", f"response_format {response_format!r} must be b64_json or url")
    encoding = _encoding(values.get("output_format"), number("output_compression", whole=True))
    for name in (*IGNORED, "preset", "cache"):
        if values.get(name) is not None and not isinstance(values[name], str):
            raise FieldError(name, f"{name} must be text, not {values[name]!r}")
    preset = values.get("preset")
    width, height = _size(values.get("size"))
    request = request_of(
        pipe,
        API_FIELDS,
        text_field("prompt", values.get("prompt")),
        negative_prompt=None if negative is None else text_field("negative_prompt", negative),
        width=width,
        height=height,
        num_inference_steps=number("num_inference_steps", whole=True),
        true_cfg_scale=number("true_cfg_scale", whole=False),
        seed=random_seed() if seed is None else seed,
        num_images_per_prompt=n,
        preset=preset or None,
        cache=values.get("cache"),
        lora_scales=_lora_scales(values.get("lora_scales"), getattr(pipe, "loras", {}), text_numbers),
        image=images or None,
        init_image=None if start is None else start[0],
        mask_image=mask if start is None else start[1],
        strength=number("strength", whole=False),
        padding_mask_crop=number("padding_mask_crop", whole=True),
        control_image=_control_images(values.get("control_image")),
        control_mask=_one_image(values.get("control_mask"), "control_mask"),
        controlnet_conditioning_scale=values.get("controlnet_conditioning_scale"),
        control_mode=values.get("control_mode"),
        control_guidance_start=_or(number("control_guidance_start", whole=False), 0.0),
        control_guidance_end=_or(number("control_guidance_end", whole=False), 1.0),
        layers=number("layers", whole=True),
        resolution=number("resolution", whole=True),
        use_en_prompt=_flag(values.get("use_en_prompt"), "use_en_prompt"),
        fast_decode=_flag(values.get("fast_decode"), "fast_decode"),
    )
    job = Job(None, variant, request)
    check_work(job, limits)
    return job, response_format, encoding


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


def _or(value: Any, default: float) -> Any:
    return default if value is None else value


def _control_images(value: Any) -> list[PIL.Image.Image] | None:
    """The `control_image` extension field: one base64 image (a data URL too) or a list of them."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(item, str) for item in items):
        raise FieldError("control_image", "control_image must be a base64 image or a list of them")
    return [_base64_image(item, f"control image {i}", "control_image") for i, item in enumerate(items, 1)]


def _one_image(value: Any, param: str) -> PIL.Image.Image | None:
    """An extension field holding one base64 image (None when absent)."""
    if value is None:
        return None
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
