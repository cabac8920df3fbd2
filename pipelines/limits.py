"""Argument limits and checks shared by the pipeline, the CLI, the UI and eval.

Cheap to import (no torch), so the CLI and the UI refuse a bad call before any model loads.
"""

import math

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import MAX_SEQUENCE_LENGTH

MAX_SIDE = 2048
DTYPE_NAMES = ("bf16", "fp32")
MIN_STEPS = 2  # one step divides by zero in the scheduler's terminal-shift stretch
MAX_STEPS = 200
MAX_IMAGES_PER_PROMPT = 16


def check_size(width: object, height: object, multiple: int) -> None:
    """InputError unless both sides are multiples of `multiple` in [multiple, MAX_SIDE]."""
    check_side("width", width, multiple)
    check_side("height", height, multiple)


def check_side(name: str, side: object, multiple: int) -> None:
    """InputError unless `side` is a multiple of `multiple` in [multiple, MAX_SIDE]."""
    if not _is_int(side) or side % multiple or not multiple <= side <= MAX_SIDE:
        raise InputError(
            f"{name} {side} must be a multiple of {multiple} between {multiple} and {MAX_SIDE}", name
        )


def check_steps(steps: object) -> None:
    """InputError unless MIN_STEPS <= steps <= MAX_STEPS."""
    if not _is_int(steps) or not MIN_STEPS <= steps <= MAX_STEPS:
        raise InputError(
            f"num_inference_steps {steps} must be between {MIN_STEPS} and {MAX_STEPS} "
            "(a single step divides by zero in the scheduler's terminal-shift stretch)",
            "num_inference_steps",
        )


def as_prompt_list(value: object, name: str) -> list[str] | None:
    """A prompt argument as a list of strings (None stays None); InputError for anything else."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(p, str) for p in items):
        raise InputError(f"{name} must be a string or a non-empty list of strings", name)
    return items


def check_generation_args(
    prompts: list[str] | None,
    negatives: list[str] | None,
    width: object,
    height: object,
    steps: object,
    true_cfg_scale: object,
    num_images_per_prompt: object,
    max_sequence_length: object,
    seed: object,
    size_multiple: int,
) -> None:
    """Raise InputError naming the first invalid generation argument. Width, height, steps and
    true_cfg_scale may be None before a model loads (the model's defaults apply); the pipeline checks
    them again once they are resolved."""
    if not prompts or any(not p.strip() for p in prompts):
        raise InputError("prompt is empty: describe the image to generate", "prompt")
    if negatives is not None and len(negatives) not in (1, len(prompts)):
        raise InputError(
            f"{len(negatives)} negative prompts for {len(prompts)} prompts: give one or one each",
            "negative_prompt",
        )
    for name, side in (("width", width), ("height", height)):
        if side is not None:
            check_side(name, side, size_multiple)
    if steps is not None:
        check_steps(steps)
    if true_cfg_scale is not None and not (
        _is_number(true_cfg_scale) and math.isfinite(true_cfg_scale) and true_cfg_scale >= 0
    ):
        raise InputError(f"true_cfg_scale {true_cfg_scale} must be a finite number >= 0", "true_cfg_scale")
    if not _is_int(num_images_per_prompt) or not 1 <= num_images_per_prompt <= MAX_IMAGES_PER_PROMPT:
        raise InputError(
            f"num_images_per_prompt {num_images_per_prompt} must be between 1 and {MAX_IMAGES_PER_PROMPT}",
            "num_images_per_prompt",
        )
    if not _is_int(max_sequence_length) or not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise InputError(
            f"max_sequence_length {max_sequence_length} must be between 1 and {MAX_SEQUENCE_LENGTH}",
            "max_sequence_length",
        )
    seeds = seed if isinstance(seed, list) else [seed]
    if isinstance(seed, list) and len(seed) != len(prompts):
        raise InputError(
            f"{len(seed)} seeds for {len(prompts)} prompts: give one seed, or one per prompt", "seed"
        )
    for each in seeds:
        if each is not None and (not _is_int(each) or not 0 <= each < 2**63):
            raise InputError(f"seed {each} must be an integer in [0, 2**63)", "seed")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


MAX_INPUT_PIXELS = 4096 * 4096  # an input image larger than this is refused (models resize to ~1 MP)


def check_image_count(count: int, max_images: int, required: bool, model: str) -> None:
    """InputError when a model cannot take `count` input images: it takes none, fewer, or needs one."""
    if count == 0:
        if required:
            raise InputError(f"{model} works on input images: give at least one input image", "image")
        return
    if max_images == 0:
        raise InputError(f"{model} generates from text only and takes no input images", "image")
    if count > max_images:
        raise InputError(f"{count} input images, but {model} takes at most {max_images}", "image")


def check_pixels(width: int, height: int, what: str, field: str = "image") -> None:
    """InputError for an image above MAX_INPUT_PIXELS (read from its header, before it is decoded); `field`:
    the request option it came in."""
    if width * height > MAX_INPUT_PIXELS:
        raise InputError(
            f"{what} is {width}x{height}: at most {MAX_INPUT_PIXELS / 1e6:.1f} MP (4096x4096)", field
        )


def check_images(images: object, max_images: int, required: bool, model: str) -> list:
    """The request's input images as a list (PIL images; empty without any), checked against what the model
    takes: InputError for a model that takes none, too many, a non-image or an image above the pixel cap."""
    import PIL.Image

    found = [] if images is None else list(images) if isinstance(images, list | tuple) else [images]
    check_image_count(len(found), max_images, required, model)
    for i, each in enumerate(found, 1):
        if not isinstance(each, PIL.Image.Image):
            raise InputError(f"input image {i} is a {type(each).__name__}, not a PIL image", "image")
        check_pixels(each.width, each.height, f"input image {i}")
    return found
