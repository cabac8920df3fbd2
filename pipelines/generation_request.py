"""One generation request, resolved once: what every front end (`generate()`, the CLI, the web demo, the HTTP
server) turns its raw values into, through one function (`resolve_request`), and what `Pipeline.run` runs.
Torch-free, so a front end checks a request before any model loads.

A new generation option is declared in pipelines/options.py (docs/DESIGN.md, "Adding a request option"),
then added here: a field of `GenerationRequest`, its default and check in `resolve_request`; the front ends
derive their flags, fields and controls from the declaration. Every InputError raised here names the
option it concerns (`field`).
"""

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import PIL.Image

from qwen_image_fusion.models.cache_presets import CachePreset, get_cache_preset
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import DEFAULT_SEQUENCE_LENGTH, CheckpointSpec, calculate_dimensions
from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.pipelines.control import Control, check_control
from qwen_image_fusion.pipelines.limits import (
    as_prompt_list,
    check_generation_args,
    check_images,
    check_pixels,
)
from qwen_image_fusion.pipelines.options import DEFAULT_LAYERS, DEFAULT_STRENGTH, MAX_LAYERS, OPTION
from qwen_image_fusion.pipelines.presets import check_lora_scale, get_preset

SizeSuggestion = Callable[[list[PIL.Image.Image]], tuple[int, int] | None]


@dataclass(frozen=True)
class StartImage:
    """img2img and inpainting: the image a request starts from, the share of the schedule that reworks it
    (`strength`: 1 starts from pure noise), the mask of what may change (white: repaint; None: all), and
    diffusers' `padding_mask_crop` (None: the whole image is generated; pixels: only the mask's box, that
    much wider, pasted back into the image)."""

    image: PIL.Image.Image
    strength: float = DEFAULT_STRENGTH
    mask: PIL.Image.Image | None = None
    padding_mask_crop: int | None = None

    def first_step(self, steps: int) -> int:
        """The index of the first of `steps` steps that runs (diffusers' `get_timesteps`)."""
        return int(max(steps - min(steps * self.strength, steps), 0))


@dataclass(frozen=True)
class GenerationRequest:
    """Every value of one request, set and checked: the checkpoint's defaults and the preset's steps and CFG
    scale applied where the caller gave none. `seed` None is drawn when it runs (shared by every rank);
    an int seeds all rows' noise at once, a tuple each prompt's rows with its own seed. `lora_scales`
    are set on the pipeline before it runs (and stay set)."""

    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...] | None  # one per prompt; None: no negative prompt
    width: int
    height: int
    num_inference_steps: int
    true_cfg_scale: float
    seed: int | tuple[int, ...] | None = None
    num_images_per_prompt: int = 1
    max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH
    images: tuple[PIL.Image.Image, ...] = ()  # input images (edits, condition images), shared by every prompt
    preset: str | None = None  # its scheduler samples the steps
    lora_scales: tuple[tuple[str, float], ...] = ()
    cache: CachePreset | None = None  # a step cache (opt-in, approximate); None: every block runs
    start: StartImage | None = None  # img2img / inpainting; None: from noise
    control: Control | None = None  # ControlNet control images; None: none
    layers: int | None = None  # Qwen-Image-Layered: RGBA layers per image; None: one image per row
    use_en_prompt: bool = False  # a captioned empty prompt: the English caption instruction (else Chinese)
    fast_decode: bool = False  # the VAE's 2D single-frame decode (opt-in: close, not identical)

    @property
    def captioned(self) -> bool:
        """Whether its one prompt is empty, so a model that captions fills it (diffusers' "", " ")."""
        return len(self.prompts) == 1 and self.prompts[0] in ("", " ")

    @property
    def steps_run(self) -> int:
        """Denoising steps it runs: with a start image, the last `strength` share of the schedule."""
        steps = self.num_inference_steps
        return steps if self.start is None else steps - self.start.first_step(steps)

    @property
    def true_cfg(self) -> bool:
        """Whether true CFG runs: a negative prompt and a scale above 1 (two transformer calls per step)."""
        return self.negative_prompts is not None and self.true_cfg_scale > 1

    @property
    def rows(self) -> int:
        """Images it makes: its rows in every denoising step."""
        return len(self.prompts) * self.num_images_per_prompt

    @property
    def outputs(self) -> int:
        """Images it returns: one per row, or each row's layers."""
        return self.rows * (self.layers or 1)

    def workload(
        self, rows: int | None = None, text_tokens: int | None = None, prompts: int | None = None
    ) -> Workload:
        """This request as a memory plan sees it, at `rows` image rows per step (a batch it shares; it is
        still decoded alone), `text_tokens` per prompt (default: its `max_sequence_length`) and `prompts`
        per text-encoder call (default: its own; a batch's when they share calls)."""
        return Workload(
            self.width,
            self.height,
            self.rows if rows is None else rows,
            len(self.prompts) if prompts is None else prompts,
            self.max_sequence_length if text_tokens is None else text_tokens,
            self.true_cfg,
            len(self.images),
            decode_images=self.rows,
            step_cache=self.cache is not None,
            start_image=self.start is not None,
        )

    @property
    def batch_key(self) -> tuple | None:
        """What requests sharing denoising steps must agree on (all but prompt, negative prompt and seed);
        None for one that runs alone: input images, a start image, control images, several prompts, or a
        seed drawn when it runs."""
        alone = self.images or self.start or self.control
        if alone or len(self.prompts) != 1 or not isinstance(self.seed, int):
            return None
        return (
            self.width,
            self.height,
            self.num_inference_steps,
            self.true_cfg_scale,
            self.true_cfg,
            self.num_images_per_prompt,
            self.max_sequence_length,
            self.preset,
            self.lora_scales,
            self.cache,
        )


def resolve_request(
    spec: CheckpointSpec,
    prompt: str | Sequence[str],
    negative_prompt: str | Sequence[str] | None = None,
    width: int | None = None,
    height: int | None = None,
    num_inference_steps: int | None = None,
    true_cfg_scale: float | None = None,
    seed: int | Sequence[int] | None = None,
    num_images_per_prompt: int = 1,
    max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
    preset: str | None = None,
    lora_scales: Mapping[str, float] | None = None,
    image: PIL.Image.Image | Sequence[PIL.Image.Image] | None = None,
    suggest_size: SizeSuggestion | None = None,
    loras: Collection[str] | None = None,
    cache: str | CachePreset | None = None,
    init_image: PIL.Image.Image | None = None,
    strength: float | None = None,
    mask_image: PIL.Image.Image | None = None,
    padding_mask_crop: int | None = None,
    control_image: PIL.Image.Image | Sequence[PIL.Image.Image] | None = None,
    controlnet_conditioning_scale: float | Sequence[float] | None = None,
    control_guidance_start: float = 0.0,
    control_guidance_end: float = 1.0,
    control_mode: str | None = None,
    control_mask: PIL.Image.Image | None = None,
    layers: int | None = None,
    resolution: int | None = None,
    use_en_prompt: bool = False,
    fast_decode: bool = False,
) -> GenerationRequest:
    """The request for `spec`'s checkpoint from raw values (docs/API.md, `Pipeline.generate`): each side not
    given is what the input images suggest (`suggest_size`, the loaded model's; without it, or without
    images, the checkpoint's default size), the negative prompt defaults to the checkpoint's, steps and CFG
    scale to the preset's or the checkpoint's; `cache` names a step-cache preset (or is "off"); `init_image`
    starts from an image (img2img; its size is the default, down to the checkpoint's default area), with
    `mask_image` only its white part (inpainting; on a checkpoint that `inpaints_input`, the part of its
    input image, at the size the image suggests), `padding_mask_crop` generating only the mask's box that
    many pixels wider; `control_image`s guide a ControlNet checkpoint
    (pipelines/control.py; the first one's size is the default; `control_mask` the part an inpainting
    ControlNet repaints); `layers` is how many RGBA layers a Qwen-Image-Layered checkpoint decomposes the
    image into (an empty prompt is then its caption: `use_en_prompt` asks for it in English, else Chinese, as
    diffusers); `resolution` sets the size as a square of that side at the first input image's aspect
    (diffusers' Layered `resolution`); `fast_decode` decodes with the VAE's 2D form (opt-in, close to the
    exact decode, not identical: models/vae_decode.py). InputError names the first bad value;
    `loras`, when given, are the LoRA names `lora_scales` may set."""
    prompts = as_prompt_list(prompt, "prompt")
    images = check_images(image, spec.max_images, spec.images_required, spec.name)
    start = check_start(spec, init_image, strength, mask_image, padding_mask_crop, images)
    control = check_control(
        spec,
        control_image,
        controlnet_conditioning_scale,
        control_guidance_start,
        control_guidance_end,
        control_mode,
        control_mask,
    )
    if control is not None and start is not None:
        raise InputError("control_image does not combine with init_image: give one of them", "control_image")
    cache = get_cache_preset(cache)
    if control is not None and cache is not None:
        raise InputError(
            "cache: a step cache is not built for ControlNet requests yet: leave it out", "cache"
        )
    layers = check_layers(spec, layers)
    if not isinstance(use_en_prompt, bool) or (use_en_prompt and not spec.captions):
        raise InputError(
            f"use_en_prompt: {spec.name} does not caption images (Qwen-Image-Layered does)", "use_en_prompt"
        )
    if not isinstance(fast_decode, bool):
        raise InputError(f"fast_decode must be true or false, not {fast_decode!r}", "fast_decode")
    if fast_decode and not spec.fast_decode:
        raise InputError(
            f"fast_decode: {spec.name}'s VAE has no faster form (its convolutions are 2D already)",
            "fast_decode",
        )
    if layers is not None and cache is not None:
        raise InputError("cache: a step cache is not built for Qwen-Image-Layered yet: leave it out", "cache")
    suggested = suggest_size(images) if images and suggest_size is not None else None
    if resolution is not None:
        suggested = resolution_size(resolution, images, width, height, spec.size_multiple)
    if start is not None and spec.inpaints_input:
        check_inpainting_edit(width, height, prompts)
    elif start is not None or control is not None:
        suggested = start_size(start.image if control is None else control.images[0], spec)
    size = suggested or (spec.defaults.width, spec.defaults.height)
    width, height = size[0] if width is None else width, size[1] if height is None else height
    negative = spec.defaults.negative_prompt if negative_prompt is None else negative_prompt
    negatives = as_prompt_list(negative, "negative_prompt")
    suggested_run = get_preset(preset, spec.family.name) or spec.defaults
    steps = suggested_run.num_inference_steps if num_inference_steps is None else num_inference_steps
    scale = suggested_run.true_cfg_scale if true_cfg_scale is None else true_cfg_scale
    if isinstance(seed, tuple):
        seed = list(seed)
    captioned = spec.captions and prompts in ([""], [" "])  # the model writes it (diffusers' rule)
    check_generation_args(
        ["caption"] if captioned else prompts,
        negatives,
        width,
        height,
        steps,
        scale,
        num_images_per_prompt,
        max_sequence_length,
        seed,
        spec.size_multiple,
    )
    if control is not None:
        control.check_aspect(width, height, spec.size_multiple)
    if start is not None and start.first_step(steps) >= steps:
        raise InputError(
            f"strength {start.strength} leaves none of the {steps} steps to run: raise either", "strength"
        )
    if negatives is not None and len(negatives) == 1:
        negatives = negatives * len(prompts)
    return GenerationRequest(
        prompts=tuple(prompts),
        negative_prompts=None if negatives is None else tuple(negatives),
        width=width,
        height=height,
        num_inference_steps=steps,
        true_cfg_scale=scale,
        seed=tuple(seed) if isinstance(seed, list) else seed,
        num_images_per_prompt=num_images_per_prompt,
        max_sequence_length=max_sequence_length,
        images=tuple(images),
        preset=preset,
        lora_scales=checked_lora_scales(lora_scales, loras),
        cache=cache,
        start=start,
        control=control,
        layers=layers,
        use_en_prompt=use_en_prompt,
        fast_decode=fast_decode,
    )


def check_start(
    spec: CheckpointSpec,
    image: object,
    strength: object,
    mask: object,
    padding_mask_crop: object = None,
    images: Sequence[PIL.Image.Image] = (),
) -> StartImage | None:
    """The request's start image (None without one), checked: InputError for a strength, mask or crop without
    an image, a model that does not start from images, a non-image, a strength outside (0, 1], a mask of
    another size than the image, or a bad crop. A checkpoint that `inpaints_input` starts from its one input
    image (`images`, checked) when given a mask, and takes no `init_image`."""
    named = ((strength, "strength"), (mask, "mask_image"), (padding_mask_crop, "padding_mask_crop"))
    given = [name for value, name in named if value is not None]
    if image is None and not given:
        return None
    if spec.inpaints_input:
        if image is not None:
            raise InputError(
                f"init_image: {spec.name} inpaints its input image: give mask_image (and strength) with the "
                "image to edit",
                "init_image",
            )
        if mask is None:
            raise InputError(
                f"{given[0]} needs mask_image: {spec.name} starts from its input image to inpaint", given[0]
            )
        image, source = images[0], "the input image"
    elif image is None and spec.max_images:
        raise InputError(f"{given[0]}: {spec.name} neither inpaints nor starts from an image", given[0])
    elif image is None:
        raise InputError(f"{given[0]} needs the image it applies to (init_image)", given[0])
    elif not spec.starts_from_image:
        raise InputError(
            f"{spec.name} does not start from an image: img2img and inpainting run on Qwen-Image "
            "text-to-image checkpoints",
            "init_image",
        )
    else:
        source = "init_image"
    for value, name in ((image, "init_image"), (mask, "mask_image")):
        if value is not None and not isinstance(value, PIL.Image.Image):
            raise InputError(f"{name} is a {type(value).__name__}, not a PIL image", name)
        if value is not None:
            check_pixels(value.width, value.height, name, name)
    if strength is None:
        strength = DEFAULT_STRENGTH
    if isinstance(strength, bool) or not isinstance(strength, int | float) or not 0 < strength <= 1:
        raise InputError(
            f"strength must be a number in {OPTION['strength'].bounds}, got {strength!r}", "strength"
        )
    if mask is not None and mask.size != image.size:
        raise InputError(
            f"mask_image is {mask.width}x{mask.height} but {source} is {image.width}x{image.height}: "
            "give a mask of the image's size",
            "mask_image",
        )
    check_mask_crop(padding_mask_crop, mask)
    return StartImage(image, float(strength), mask, padding_mask_crop)


def check_mask_crop(padding_mask_crop: object, mask: PIL.Image.Image | None) -> None:
    """InputError unless `padding_mask_crop` is None, or a whole number of pixels >= 0 with a mask that has a
    white (non-black) pixel to crop around."""
    if padding_mask_crop is None:
        return
    if mask is None:
        raise InputError(
            "padding_mask_crop needs mask_image: it crops to the mask's white part", "padding_mask_crop"
        )
    if isinstance(padding_mask_crop, bool) or not isinstance(padding_mask_crop, int) or padding_mask_crop < 0:
        raise InputError(
            f"padding_mask_crop must be a whole number of pixels >= 0, got {padding_mask_crop!r}",
            "padding_mask_crop",
        )
    if mask.convert("L").getbbox() is None:
        raise InputError(
            "padding_mask_crop: mask_image is all black, with no part to crop around", "padding_mask_crop"
        )


def check_inpainting_edit(width: int | None, height: int | None, prompts: Sequence[str]) -> None:
    """InputError for a size or several prompts in an inpainting edit: diffusers'
    `QwenImageEditInpaintPipeline` makes it at the size its image suggests (it ignores width and height) and
    pairs a prompt batch's rows with other samples of the image, so one prompt runs per request."""
    if width is not None or height is not None:
        raise InputError(
            "width and height: an inpainting edit is made at the size its image suggests",
            "width" if width is not None else "height",
        )
    if len(prompts) > 1:
        raise InputError(
            f"prompt: an inpainting edit takes one prompt per request, got {len(prompts)}", "prompt"
        )


def check_layers(spec: CheckpointSpec, layers: object) -> int | None:
    """The request's layer count: DEFAULT_LAYERS for a checkpoint that `decomposes`, None otherwise;
    InputError for layers asked of another checkpoint or outside 1..MAX_LAYERS."""
    if not spec.decomposes:
        if layers is not None:
            raise InputError(
                f"layers: {spec.name} does not decompose images into layers (Qwen-Image-Layered does)",
                "layers",
            )
        return None
    if layers is None:
        return DEFAULT_LAYERS
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
        raise InputError(f"layers must be an integer in 1..{MAX_LAYERS}, got {layers!r}", "layers")
    return layers


def resolution_size(
    resolution: object,
    images: list[PIL.Image.Image],
    width: int | None,
    height: int | None,
    multiple: int,
) -> tuple[int, int]:
    """The size of a `resolution` x `resolution` area at the first input image's aspect, each side rounded
    to 32 then floored to `multiple` (diffusers' Layered pipeline); InputError without an image, with an
    explicit width or height, or for a resolution that is not an integer in 256..4096."""
    if width is not None or height is not None:
        raise InputError(
            "resolution sets width and height: give either resolution or width/height", "resolution"
        )
    if not images:
        raise InputError("resolution needs an input image: it keeps the image's aspect", "resolution")
    if isinstance(resolution, bool) or not isinstance(resolution, int) or not 256 <= resolution <= 4096:
        raise InputError(
            f"resolution must be an integer in {OPTION['resolution'].bounds}, got {resolution!r}",
            "resolution",
        )
    width, height = calculate_dimensions(resolution * resolution, images[0].width / images[0].height)
    return max(multiple, width // multiple * multiple), max(multiple, height // multiple * multiple)


def start_size(image: PIL.Image.Image, spec: CheckpointSpec) -> tuple[int, int]:
    """A start (or control) image's size rounded down to the checkpoint's size multiple, scaled down (same
    aspect) to the checkpoint's default area when larger."""
    width, height = image.size
    scale = min(1.0, math.sqrt(spec.defaults.width * spec.defaults.height / (width * height)))
    multiple = spec.size_multiple
    return tuple(max(multiple, int(side * scale) // multiple * multiple) for side in (width, height))


def checked_lora_scales(
    scales: Mapping[str, float] | None, loras: Collection[str] | None
) -> tuple[tuple[str, float], ...]:
    """`scales` as sorted (name, scale) pairs, each a finite number for a loaded LoRA (when `loras` says
    which are loaded); InputError naming the first bad one."""
    if scales is None:
        return ()
    if not isinstance(scales, Mapping):
        raise InputError("lora_scales must be a mapping of {LoRA name: scale}", "lora_scales")
    checked = []
    for name, scale in scales.items():
        if loras is not None and name not in loras:
            raise InputError(
                f"lora_scales: no LoRA named {name!r} is loaded (loaded: {', '.join(loras) or 'none'})",
                "lora_scales",
            )
        try:
            checked.append((name, check_lora_scale(scale, name)))
        except InputError as err:
            raise InputError(f"lora_scales: {err}", "lora_scales") from None
    return tuple(sorted(checked))
