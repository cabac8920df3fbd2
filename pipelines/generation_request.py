"""One generation request, resolved once: what every front end (`generate()`, the CLI, the web demo, the HTTP
server) turns its raw values into, through one function (`resolve_request`), and what `Pipeline.run` runs.
Torch-free, so a front end checks a request before any model loads.

A new generation option is added here: a field of `GenerationRequest`, its default and check in
`resolve_request`; then its use in `Pipeline.run`, and the front ends that expose it pass it on by name.
"""

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import PIL.Image

from models.cache_presets import CachePreset, get_cache_preset
from models.errors import InputError
from models.family import DEFAULT_SEQUENCE_LENGTH, CheckpointSpec
from models.memory import Workload
from pipelines.limits import as_prompt_list, check_generation_args, check_images
from pipelines.presets import check_lora_scale, get_preset

SizeSuggestion = Callable[[list[PIL.Image.Image]], tuple[int, int] | None]


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

    @property
    def true_cfg(self) -> bool:
        """Whether true CFG runs: a negative prompt and a scale above 1 (two transformer calls per step)."""
        return self.negative_prompts is not None and self.true_cfg_scale > 1

    @property
    def rows(self) -> int:
        """Images it makes: its rows in every denoising step."""
        return len(self.prompts) * self.num_images_per_prompt

    def workload(self, rows: int | None = None, text_tokens: int | None = None) -> Workload:
        """This request as a memory plan sees it, at `rows` image rows per step (a batch it shares; it is
        still decoded alone) and `text_tokens` per prompt (default: its `max_sequence_length`)."""
        return Workload(
            self.width,
            self.height,
            self.rows if rows is None else rows,
            len(self.prompts),
            self.max_sequence_length if text_tokens is None else text_tokens,
            self.true_cfg,
            len(self.images),
            decode_images=self.rows,
            step_cache=self.cache is not None,
        )

    @property
    def batch_key(self) -> tuple | None:
        """What requests sharing denoising steps must agree on (all but prompt, negative prompt and seed);
        None for one that runs alone: input images, several prompts, or a seed drawn when it runs."""
        if self.images or len(self.prompts) != 1 or not isinstance(self.seed, int):
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
) -> GenerationRequest:
    """The request for `spec`'s checkpoint from raw values (docs/API.md, `Pipeline.generate`): each side not
    given is what the input images suggest (`suggest_size`, the loaded model's; without it, or without
    images, the checkpoint's default size), the negative prompt defaults to the checkpoint's, steps and CFG
    scale to the preset's or the checkpoint's; `cache` names a step-cache preset (or is "off"). InputError
    names the first bad value; `loras`, when given, are the LoRA names `lora_scales` may set."""
    prompts = as_prompt_list(prompt, "prompt")
    images = check_images(image, spec.max_images, spec.images_required, spec.name)
    suggested = suggest_size(images) if images and suggest_size is not None else None
    size = suggested or (spec.defaults.width, spec.defaults.height)
    width, height = size[0] if width is None else width, size[1] if height is None else height
    negative = spec.defaults.negative_prompt if negative_prompt is None else negative_prompt
    negatives = as_prompt_list(negative, "negative_prompt")
    suggested_run = get_preset(preset, spec.family.name) or spec.defaults
    steps = suggested_run.num_inference_steps if num_inference_steps is None else num_inference_steps
    scale = suggested_run.true_cfg_scale if true_cfg_scale is None else true_cfg_scale
    if isinstance(seed, tuple):
        seed = list(seed)
    check_generation_args(
        prompts,
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
        cache=get_cache_preset(cache),
    )


def checked_lora_scales(
    scales: Mapping[str, float] | None, loras: Collection[str] | None
) -> tuple[tuple[str, float], ...]:
    """`scales` as sorted (name, scale) pairs, each a finite number for a loaded LoRA (when `loras` says
    which are loaded); InputError naming the first bad one."""
    if scales is None:
        return ()
    if not isinstance(scales, Mapping):
        raise InputError("lora_scales must be a mapping of {LoRA name: scale}")
    checked = []
    for name, scale in scales.items():
        if loras is not None and name not in loras:
            raise InputError(
                f"lora_scales: no LoRA named {name!r} is loaded (loaded: {', '.join(loras) or 'none'})"
            )
        try:
            checked.append((name, check_lora_scale(scale, name)))
        except InputError as err:
            raise InputError(f"lora_scales: {err}") from None
    return tuple(sorted(checked))
