"""The HTTP request bodies as pydantic models, built from the declared request options (pipelines/options.py)
plus OpenAI's own fields: each field's type, default, bounds and description are its option's. The server
publishes them in /openapi.json, so a client sees the same surface the CLI's --help and the demo show;
tests hold them equal to the declarations."""

from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from qwen_image_fusion.pipelines.options import (
    CHOICE,
    EDITS,
    FLAG,
    IMAGE,
    IMAGES,
    NUMBER,
    NUMBERS,
    REQUIRED,
    SCALES,
    TEXT,
    WHOLE,
    Option,
    http_options,
)
from qwen_image_fusion.ui.api_request import IGNORED, RESPONSE_FORMATS
from qwen_image_fusion.ui.image_cache import MEDIA_TYPES

SIZE_HELP = "WIDTHxHEIGHT, or auto (the model's size): {}"
OPENAI_FIELDS: dict[str, Any] = {
    "model": (str | None, Field(None, description="the served model's id (GET /v1/models)")),
    "response_format": (Literal[RESPONSE_FORMATS] | None, Field("b64_json", description="b64_json or url")),
    "output_format": (Literal[tuple(MEDIA_TYPES)] | None, Field("png", description="the images' format")),
    "output_compression": (
        int | None,
        Field(None, ge=0, le=100, description="jpeg and webp quality, 0-100 (default 100)"),
    ),
} | {name: (str | None, Field(None, description="accepted and ignored (OpenAI's)")) for name in IGNORED}
KINDS: dict[str, Any] = {
    TEXT: str,
    WHOLE: int,
    NUMBER: float,
    NUMBERS: float | list[float],
    FLAG: bool,
    SCALES: dict[str, float],
    IMAGE: str,  # base64 (a data URL too); an edit's multipart file
    IMAGES: str | list[str],
}


def option_field(option: Option, route: str) -> tuple[Any, Any]:
    """(annotation, Field) of `option`'s body field on `route`: its kind, its `generate()` default, its
    bounds (where a server takes the request: `served_bounds`) and its help."""
    kind = Literal[option.choices] if option.kind == CHOICE else KINDS[option.kind]
    if route == EDITS and option.kind in (IMAGE, IMAGES):
        kind = list[bytes] if option.kind == IMAGES else bytes
    low, high = option.served_bounds
    bounds = {"le": high} | ({"gt": low} if option.low_open else {"ge": low})
    bounds = {key: value for key, value in bounds.items() if value is not None}
    default = ... if option.default is REQUIRED else option.given_default
    return kind | None, Field(default, description=option.help, **bounds)


@cache
def body_model(route: str) -> type[BaseModel]:
    """The body `route` takes: each request option declared for it under its field's name (`size` stands
    for width and height, an edit's `image` for its input or start image), then OpenAI's own fields."""
    by_field: dict[str, list[Option]] = {}
    for option, name in http_options(route):
        by_field.setdefault(name, []).append(option)
    fields: dict[str, Any] = {}
    for name, options in by_field.items():
        if name == "size":
            sides = "; ".join(f"{o.help} ({o.bounds})" for o in options)
            fields[name] = (str | None, Field(None, description=SIZE_HELP.format(sides)))
        elif len(options) > 1:  # one field, whichever option the model reads it as
            kind, first = option_field(options[0], route)
            help = " | ".join(f"{o.name}: {o.help}" for o in options)
            fields[name] = (kind, Field(first.default, description=help))
        else:
            fields[name] = option_field(options[0], route)
    return create_model(f"Images{route.title()}Body", **fields, **OPENAI_FIELDS)


def request_body(route: str) -> dict[str, Any]:
    """The OpenAPI `requestBody` of `route`: JSON for generations, a multipart form for edits."""
    media = "multipart/form-data" if route == EDITS else "application/json"
    schema = body_model(route).model_json_schema()
    return {"requestBody": {"required": True, "content": {media: {"schema": schema}}}}
