"""Every request option, declared once: its `generate()` keyword, kind, default, bounds, one-line help, and
the name each front end gives it (CLI flag per command, HTTP field per route, demo control, eval worker
key). The CLI flags, the HTTP body model, the demo's control ranges and the eval worker's arguments are
built from these declarations; `resolve_request` checks values against the same bounds, and an InputError
names the option (its `field`), which each front end maps back to its own name with `front_end_name`.

Torch-free, so a front end builds its surface before any model loads. Adding an option: docs/DESIGN.md,
"Adding a request option".
"""

import argparse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from qwen_image_fusion.models.cache_presets import CACHE_OFF, CACHE_PRESETS
from qwen_image_fusion.models.family import (
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_TRUE_CFG_SCALE,
    MAX_SEQUENCE_LENGTH,
)
from qwen_image_fusion.pipelines.control import CONTROL_MODES
from qwen_image_fusion.pipelines.limits import MAX_IMAGES_PER_PROMPT, MAX_SIDE, MAX_STEPS, MIN_STEPS
from qwen_image_fusion.pipelines.presets import PRESETS


class Default:
    """A default no value stands for: the checkpoint decides (its defaults, a preset, its input images), or
    the caller must give one."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


FROM_MODEL, REQUIRED = Default("FROM_MODEL"), Default("REQUIRED")
TEXT, NUMBER, NUMBERS, WHOLE, FLAG, CHOICE, IMAGE, IMAGES, SCALES = (
    "text", "number", "numbers", "whole", "flag", "choice", "image", "images", "scales",
)  # fmt: skip
GENERATE, EDIT, LAYERS = "generate", "edit", "layers"  # the CLI commands that run a request
CLI_COMMANDS = (GENERATE, EDIT, LAYERS)
GENERATIONS, EDITS = "generations", "edits"  # the HTTP routes /v1/images/generations and /v1/images/edits
MAX_SEED = 2**63 - 1
DEFAULT_STRENGTH = 0.6  # diffusers' img2img and inpainting default
DEFAULT_LAYERS = 4  # diffusers' QwenImageLayeredPipeline default
MAX_LAYERS = 16  # RGBA layers a request may ask for (each adds a target's worth of tokens per step)
MAX_IMAGES_PER_REQUEST = 10  # images one served request (HTTP `n`, the demo's count) may ask for


@dataclass(frozen=True)
class Option:
    """One request option. `default` is `generate()`'s default (None: a default the pipeline applies, said
    in the help), FROM_MODEL (None there: the checkpoint decides) or REQUIRED; `low`/`high` bound a number
    (inclusive; `low_open` excludes `low`); `choices` a choice's values. Front ends: `cli` maps each CLI
    command that takes it to its flag (a name without dashes is positional: its metavar), `http` maps each
    route to its field, `demo` names the demo's control and `eval` the eval worker's request key (None: not
    exposed there). `served_high` caps a number lower where a server takes requests from others (HTTP, the
    demo); `demo_range` is the span of the demo's slider where the bounds leave it open."""

    name: str
    kind: str
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    cli: Mapping[str, str] = field(default_factory=dict)
    http: Mapping[str, str] = field(default_factory=dict)
    demo: str | None = None
    eval: str | None = None
    served_high: float | None = None
    demo_range: tuple[float, float] | None = None
    model_default: str = ""  # what the checkpoints' own default usually is, for help ("1024 for Qwen-Image")

    @property
    def bounds(self) -> str:
        """The bounds in words, as help and messages give them ("" for none)."""
        if self.low is None and self.high is None:
            return ""
        low, high = (number_text(bound) for bound in (self.low, self.high))
        if self.high is None:
            return f"> {low}" if self.low_open else f">= {low}"
        if self.low is None:
            return f"<= {high}"
        return f"({low}, {high}]" if self.low_open else f"{low}..{high}"

    @property
    def given_default(self) -> Any:
        """The value a front end passes when the user gives none (None: the checkpoint decides)."""
        return None if isinstance(self.default, Default) else self.default

    @property
    def served_bounds(self) -> tuple[float | None, float | None]:
        """(low, high) where a server takes the request (`served_high` below `high`)."""
        return self.low, self.high if self.served_high is None else self.served_high


def number_text(value: float | None) -> str:
    """A bound as help shows it: whole numbers in full (a seed's 9223372036854775807), others as %g."""
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _every(flag: str, *commands: str) -> dict[str, str]:
    """The same flag in each of `commands` (default: every CLI command)."""
    return dict.fromkeys(commands or CLI_COMMANDS, flag)


def _routes(name: str, *routes: str) -> dict[str, str]:
    """The same HTTP field in each of `routes` (default: both)."""
    return dict.fromkeys(routes or (GENERATIONS, EDITS), name)


MODEL_SIZES = "1024 for Qwen-Image checkpoints, 256 for the embedded model; an edit's: its images' aspect"
SIDE = "pixels, a multiple of the model's size multiple (`qwen-image info`); input images suggest one"
OPTIONS: tuple[Option, ...] = (
    Option("prompt", TEXT, REQUIRED, "what to draw (an edit: the instruction); empty on Qwen-Image-Layered: "
           "the model captions the image", cli={GENERATE: "prompt", EDIT: "instruction", LAYERS: "--prompt"},
           http=_routes("prompt"), demo="prompt", eval="prompt"),
    Option("negative_prompt", TEXT, FROM_MODEL, "what to steer away from; with true_cfg_scale > 1 it turns "
           "true CFG on (the model's: none for diffusers checkpoints, \" \" for the embedded model)",
           cli=_every("--negative-prompt"), http=_routes("negative_prompt"), demo="negative_prompt",
           eval="negative_prompt"),
    Option("width", WHOLE, FROM_MODEL, f"image width in {SIDE}", high=MAX_SIDE, cli=_every("--width"),
           http=_routes("size"), demo="width", eval="width", model_default=MODEL_SIZES),
    Option("height", WHOLE, FROM_MODEL, f"image height in {SIDE}", high=MAX_SIDE, cli=_every("--height"),
           http=_routes("size"), demo="height", eval="height", model_default=MODEL_SIZES),
    Option("num_inference_steps", WHOLE, FROM_MODEL, "denoising steps (a preset sets its own; one step "
           "divides by zero in the scheduler's terminal-shift stretch)", low=MIN_STEPS, high=MAX_STEPS,
           cli=_every("--steps"), http=_routes("num_inference_steps"), demo="num_inference_steps",
           eval="steps", model_default="50; 20 for the embedded model"),
    Option("true_cfg_scale", NUMBER, FROM_MODEL, "true CFG scale: above 1 with a negative prompt runs two "
           "transformer calls a step; 1 turns CFG off (a preset sets 1)", low=0,
           cli=_every("--true-cfg-scale"), http=_routes("true_cfg_scale"), demo="true_cfg_scale",
           eval="true_cfg_scale", demo_range=(1.0, 10.0), model_default=f"{DEFAULT_TRUE_CFG_SCALE:g}"),
    Option("seed", WHOLE, None, "random seed (none: a random one, reported)", low=0, high=MAX_SEED,
           cli=_every("--seed"), http=_routes("seed"), demo="seed", eval="seed"),
    Option("num_images_per_prompt", WHOLE, 1, "images per prompt", low=1, high=MAX_IMAGES_PER_PROMPT,
           cli=_every("--num-images"), http=_routes("n"), demo="num_images",
           served_high=MAX_IMAGES_PER_REQUEST),
    Option("max_sequence_length", WHOLE, DEFAULT_SEQUENCE_LENGTH, "text tokens kept", low=1,
           high=MAX_SEQUENCE_LENGTH, cli=_every("--max-sequence-length", GENERATE, LAYERS)),
    Option("preset", CHOICE, None, "settings for a distilled LoRA (explicit steps and CFG scale win): "
           + "; ".join(p.describe() for p in PRESETS.values()), choices=tuple(PRESETS),
           cli=_every("--preset"), http=_routes("preset"), demo="preset"),
    Option("lora_scales", SCALES, None, "{LoRA name: scale} of loaded LoRAs, for this call only (the "
           "others at the scales they were loaded with; a server loads its LoRAs at 0)",
           http=_routes("lora_scales"), demo="lora_scales"),
    Option("image", IMAGES, None, "input images, in order: an edit's (Picture 1, 2, ...), 2.1's condition "
           "images, the image Layered decomposes (`qwen-image info` says how many a model takes)",
           cli={GENERATE: "--image", EDIT: "--image", LAYERS: "image"}, http=_routes("image", EDITS),
           demo="image_1", eval="images"),
    Option("cache", CHOICE, None, "step cache, opt-in and approximate: skip the middle blocks while the "
           "first block's output barely changes; " + "; ".join(p.describe() for p in CACHE_PRESETS.values())
           + f" ({CACHE_OFF} or none: every block runs)", choices=(CACHE_OFF, *CACHE_PRESETS),
           cli=_every("--cache"), http=_routes("cache"), demo="cache", eval="cache"),
    Option("init_image", IMAGE, None, "img2img: the image to start from (Qwen-Image checkpoints), noised to "
           "strength; the output takes its size (scaled down to the model's default area)",
           cli={GENERATE: "--init-image"}, http=_routes("image", EDITS), demo="image_1", eval="init_image"),
    Option("strength", NUMBER, None, "img2img and inpainting: the share of the schedule that reworks the "
           f"start image; 1 starts from pure noise (none: {DEFAULT_STRENGTH}, as diffusers)", low=0, high=1,
           low_open=True,
           cli=_every("--strength", GENERATE, EDIT), http=_routes("strength", EDITS), demo="strength",
           eval="strength"),
    Option("mask_image", IMAGE, None, "inpainting: repaint only the white part of the start image (an Edit "
           "checkpoint's: of its input image; grey levels binarized at 0.5; the image's size)",
           cli=_every("--mask", GENERATE, EDIT), http=_routes("mask", EDITS), demo="mask", eval="mask"),
    Option("padding_mask_crop", WHOLE, None, "with a mask: generate only the box around its white part, this "
           "many pixels wider and widened to the output's aspect, pasted back into the image", low=0,
           cli=_every("--padding-mask-crop", GENERATE, EDIT), http=_routes("padding_mask_crop", EDITS),
           demo="padding_mask_crop"),
    Option("control_image", IMAGES, None, "control maps for a ControlNet checkpoint (canny, depth, pose or "
           "soft-edge; the Union ControlNet reads which from the map); the output takes the first one's size",
           cli={GENERATE: "--control-image"}, http=_routes("control_image", GENERATIONS), demo="image_1",
           eval="control"),
    Option("controlnet_conditioning_scale", NUMBERS, None, "conditioning scale of each control image, in "
           "order (one value: every image; none: 1.0)", cli={GENERATE: "--control-scale"},
           http=_routes("controlnet_conditioning_scale", GENERATIONS), demo="control_scale",
           eval="control_scale", demo_range=(0.0, 2.0)),
    Option("control_guidance_start", NUMBER, 0.0, "the share of the steps after which the control guides",
           low=0, high=1, cli={GENERATE: "--control-start"},
           http=_routes("control_guidance_start", GENERATIONS)),
    Option("control_guidance_end", NUMBER, 1.0, "the share of the steps after which it stops guiding", low=0,
           high=1, cli={GENERATE: "--control-end"}, http=_routes("control_guidance_end", GENERATIONS)),
    Option("control_mode", CHOICE, None, "make each control map from a photo (canny: its edges) instead of "
           "giving the map", choices=CONTROL_MODES, cli={GENERATE: "--control-mode"},
           http=_routes("control_mode", GENERATIONS), demo="role", eval="control_mode"),
    Option("control_mask", IMAGE, None, "an inpainting ControlNet checkpoint: repaint the white part of its "
           "one control image (the image's size)", cli={GENERATE: "--control-mask"},
           http=_routes("control_mask", GENERATIONS), demo="mask", eval="control_mask"),
    Option("layers", WHOLE, FROM_MODEL, "Qwen-Image-Layered: RGBA layers to decompose the image into", low=1,
           high=MAX_LAYERS, cli={LAYERS: "--layers"}, http=_routes("layers", EDITS), demo="layers",
           model_default=str(DEFAULT_LAYERS)),
    Option("resolution", WHOLE, None, "Qwen-Image-Layered: the output's area as a square of this side, at "
           "the image's aspect (diffusers' buckets: 640 and 1024; none: 640, or width and height)", low=256,
           high=4096, cli={LAYERS: "--resolution"}, http=_routes("resolution", EDITS)),
    Option("use_en_prompt", FLAG, False, "with an empty prompt on Qwen-Image-Layered: caption in English "
           "(default: Chinese, as diffusers)", cli={LAYERS: "--use-en-prompt"},
           http=_routes("use_en_prompt", EDITS)),
    Option("fast_decode", FLAG, False, "decode with the VAE's 2D form, opt-in and approximate: about 40% "
           "less decoding time, a few pixel levels off the exact decode (BENCHMARKS.md, fast decode); "
           "Qwen-Image's VAE only", cli=_every("--fast-decode"), http=_routes("fast_decode"),
           demo="fast_decode", eval="fast_decode"),
)  # fmt: skip
OPTION = {option.name: option for option in OPTIONS}


def cli_options(command: str) -> Iterator[tuple[Option, str]]:
    """The options CLI `command` takes, with their flags, in declaration order."""
    return ((o, o.cli[command]) for o in OPTIONS if command in o.cli)


def http_options(route: str) -> Iterator[tuple[Option, str]]:
    """The options HTTP `route` takes, with their fields."""
    return ((o, o.http[route]) for o in OPTIONS if route in o.http)


def front_end_name(name: str | None, names: Mapping[str, str], fallback: str | None = None) -> str | None:
    """The name a front end gives request option `name` (an InputError's field), from its own map of
    option names (`names`: option -> its name); `fallback` where the option has none there or none is
    named."""
    return names.get(name, fallback) if name is not None else fallback


def add_flag(parser: argparse.ArgumentParser, option: Option, flag: str, required: bool = False) -> None:
    """`option` as an argparse argument `flag` (no dashes: positional, `flag` its metavar), built from its
    declaration: type, choices, help with bounds and default, `generate()`'s default as argparse's (None:
    the pipeline decides); images are file paths, repeatable where the option takes several."""
    positional = not flag.startswith("-")
    kwargs: dict[str, Any] = {"help": flag_help(option)}
    if positional:
        kwargs["metavar"] = flag
    else:
        kwargs |= {"dest": option.name, "default": "" if option.default is REQUIRED else option.given_default}
        if option.kind in (WHOLE, NUMBER, NUMBERS, TEXT):
            kwargs["metavar"] = flag.removeprefix("--").upper().replace("-", "_")
    if option.kind == FLAG:
        kwargs["action"] = "store_true"
    elif option.kind in (WHOLE, NUMBER, NUMBERS):
        kwargs["type"] = int if option.kind == WHOLE else float
    elif option.kind == CHOICE:
        kwargs["choices"] = option.choices
    elif option.kind in (IMAGE, IMAGES):
        kwargs.setdefault("metavar", "FILE")
    if option.kind in (IMAGES, NUMBERS) and not positional:
        kwargs["action"] = "append"
    if required:
        kwargs["required"] = True
    parser.add_argument(option.name if positional else flag, **kwargs)


def flag_help(option: Option) -> str:
    """A flag's help: the declaration's one line, its bounds, and a default the flag leaves to the model."""
    bounds = f" ({option.bounds})" if option.bounds else ""
    model = f", {option.model_default}" if option.model_default else ""
    default = f" (default: the model's{model})" if option.default is FROM_MODEL else ""
    repeat = "; repeatable, in order" if option.kind in (IMAGES, NUMBERS) and option.name != "image" else ""
    return f"{option.help}{bounds}{repeat}{default}".replace("%", "%%")  # argparse formats help with %
