"""A request's stages on a loaded pipeline: text (and image) encoding per CFG branch, the flow-matching
denoise loop (from noise, a start image or control images; eager or through captured CUDA graphs and step
caches), and decoding. Each function takes the `Pipeline` whose model, memory plan and ranks it uses; the
request loop (pipelines/request_loop.py) strings them together."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from qwen_image_fusion.models.cache_presets import CachePreset
from qwen_image_fusion.models.family import Conditioning, Decoded, StepControl
from qwen_image_fusion.models.mask_crop import MaskCrop
from qwen_image_fusion.models.memory import DENOISE, ENCODE
from qwen_image_fusion.models.step_cache import BranchCache, caching
from qwen_image_fusion.pipelines.control import Control
from qwen_image_fusion.pipelines.generation_request import GenerationRequest, StartImage
from qwen_image_fusion.pipelines.memory import in_phase
from qwen_image_fusion.pipelines.run_info import StageTimer
from qwen_image_fusion.pipelines.sampling import (
    Step,
    branch_velocities,
    euler_loop,
    flow_timesteps,
    inpaint_blend,
    strength_timesteps,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import PIL.Image

    from qwen_image_fusion.models.family import CheckpointSpec, FamilyModel
    from qwen_image_fusion.pipelines.cuda_graph import GraphedStep
    from qwen_image_fusion.pipelines.lora import LoraSet
    from qwen_image_fusion.pipelines.memory import GpuMemory
    from qwen_image_fusion.pipelines.memory_plan import MemoryPlan
    from qwen_image_fusion.pipelines.parallel import Ranks
    from qwen_image_fusion.pipelines.run_info import RunInfo


class Pipeline(Protocol):
    """What the stages and the run loop read and set of a loaded pipeline (pipelines/pipeline.py's
    `Pipeline`): its model and spec, where it runs, its memory plan, ranks, LoRAs, captured graphs and step
    caches (a protocol, so this module needs no import of the class that calls it)."""

    model: FamilyModel
    spec: CheckpointSpec
    device: torch.device
    memory: GpuMemory | None
    ranks: Ranks | None
    lora: LoraSet
    cuda_graphs: bool
    last_run: RunInfo | None
    _graphed: GraphedStep
    _caches: dict[tuple[CachePreset, int], BranchCache]

    @property
    def variant(self) -> str: ...

    def encode(
        self, prompts: list[str], max_sequence_length: int, copies: int = 1, images=None
    ) -> Conditioning: ...

    def fusion_summary(self) -> str: ...

    def parallel_summary(self) -> str: ...

    def use_call_lora_scales(self, scales: dict[str, float]) -> None: ...

    def _limit_graphs(self, plan: MemoryPlan | None = None) -> None: ...


@dataclass
class Encoded:
    """A request's conditioning per CFG branch, the seconds it took, and the model's caption that stood for
    an empty prompt ("" when none did)."""

    branches: list[Conditioning]
    timings: dict[str, float] = field(default_factory=dict)
    caption: str = ""

    @property
    def shapes(self) -> tuple:
        return tuple(
            (tuple(b.embeds.shape), None if b.mask is None else tuple(b.mask.shape)) for b in self.branches
        )


def encode_each(pipe: Pipeline, requests: list[GenerationRequest]) -> list[Encoded]:
    """Each request's conditioning per CFG branch, one request at a time."""
    encoded = []
    for request in requests:
        timer = StageTimer(pipe.device)
        with in_phase(pipe.memory, ENCODE):
            encoded.append(encode_request(pipe, request))
        timer.lap("text_encoding")
        encoded[-1].timings.update(timer.timings)
    return encoded


def encode_request(pipe: Pipeline, request: GenerationRequest) -> Encoded:
    """The request's conditioning per CFG branch (its prompts together, each repeated per image); a model
    that captions writes the prompt an empty one stands for."""
    n, length, images = request.num_images_per_prompt, request.max_sequence_length, list(request.images)
    prompts, caption = list(request.prompts), ""
    if pipe.spec.captions and request.captioned:
        caption = pipe.model.caption(images[0], request.width, request.height, request.use_en_prompt)
        prompts = [caption]
    branches = [pipe.encode(prompts, length, n, images)]
    if request.true_cfg:
        branches.append(pipe.encode(list(request.negative_prompts), length, n, images))
    return Encoded(branches, caption=caption)


def encode_together(pipe: Pipeline, requests: list[GenerationRequest], slots: int) -> list[Encoded]:
    """A batch's prompts, one CFG branch at a time, in `FamilyModel.encode_batch`'s calls of `slots` rows
    (`batch_key` holds each request of a batch to one prompt: one row each); each request's conditioning
    is its row, repeated per image, timed with the calls it shared."""
    first = requests[0]
    length, copies = first.max_sequence_length, first.num_images_per_prompt
    branches = [[r.prompts[0] for r in requests]]
    if first.true_cfg:
        branches.append([r.negative_prompts[0] for r in requests])
    timer = StageTimer(pipe.device)
    with in_phase(pipe.memory, ENCODE):
        encoded = [pipe.model.encode_batch(prompts, length, slots) for prompts in branches]
    timer.lap("text_encoding")
    return [
        Encoded([branch[i].repeat(copies) for branch in encoded], dict(timer.timings))
        for i in range(len(requests))
    ]


def denoise(
    pipe: Pipeline,
    branches: list[Conditioning],
    canvas: object,
    steps: int,
    true_cfg_scale: float,
    seed: int | list[int],
    on_step: Callable[[int, int], None] | None = None,
    progress: bool = False,
    scheduler: FlowMatchEulerDiscreteScheduler | None = None,
    caches: list[BranchCache] | None = None,
    start: StartImage | None = None,
    control: Control | None = None,
    crop: MaskCrop | None = None,
) -> torch.Tensor:
    """The flow-matching Euler loop from seeded noise; `branches` is [positive] or [positive, negative]
    (true CFG); `canvas` is the model's geometry of the request (`model.canvas`); `seed` a list gives each
    prompt's rows their own seed; `scheduler` defaults to the checkpoint's; `caches`, one per branch, a step
    cache (reset here); `start` an image to start from, noised to the first step that runs (img2img), its
    unmasked part kept (inpainting), only `crop`'s box of it generated (its `padding_mask_crop`); `control`
    the control images of a ControlNet checkpoint. Returns the final packed latents."""
    model, device = pipe.model, pipe.device
    scheduler = model.scheduler if scheduler is None else scheduler
    batch = branches[0].embeds.shape[0]
    seeds = seed if isinstance(seed, list) else [seed]
    rows = batch // len(seeds)
    after_step, step_controls = None, None
    sigmas, shift = model.sigmas(steps), model.time_shift(canvas)
    if control is not None:
        maps = list(control.images)
        parts = [model.control_start(maps, control.mask, canvas, rows, s) for s in seeds]
        latents = torch.cat([p.noise for p in parts])
        timesteps = flow_timesteps(scheduler, sigmas, latents.shape[1], device, shift)
        encoded = tuple(torch.cat(each) for each in zip(*(p.latents for p in parts), strict=True))
        step_controls = control_steps(control, len(timesteps), encoded, branches[0], device)
    elif start is None:
        latents = torch.cat([model.initial_latents(canvas, rows, s) for s in seeds])
        timesteps = flow_timesteps(scheduler, sigmas, latents.shape[1], device, shift)
    else:
        parts = [model.image_start(start.image, start.mask, canvas, rows, s, crop) for s in seeds]
        image_latents, noise = torch.cat([p.latents for p in parts]), torch.cat([p.noise for p in parts])
        canvas = model.start_canvas(canvas, image_latents)
        flow_timesteps(scheduler, sigmas, noise.shape[1], device, shift)
        timesteps = strength_timesteps(scheduler, start.first_step(steps))
        latents = scheduler.scale_noise(image_latents, timesteps[:1].repeat(batch), noise)
        if start.mask is not None:
            mask = torch.cat([p.mask for p in parts])
            after_step = inpaint_blend(scheduler, timesteps, image_latents, noise, mask)
    for cache in caches or ():
        cache.reset()
    step = transformer_step(pipe, canvas, branches, caches)
    controls = iter(step_controls or ())

    def velocity(latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        cfg = None if pipe.ranks is None else pipe.ranks.cfg
        now = step if step_controls is None else partial(step, control=next(controls))
        velocities = branch_velocities(now, latents, sigma, branches, cfg)
        if len(velocities) == 1:
            return velocities[0]
        return model.combine_cfg(*velocities, true_cfg_scale)

    return euler_loop(scheduler, timesteps, latents, velocity, on_step, progress, after_step)


def transformer_step(
    pipe: Pipeline, canvas: object, branches: list[Conditioning], caches: list[BranchCache] | None = None
) -> Step:
    """The transformer call for one request's geometry: CUDA-graph replays on CUDA, eager elsewhere; with
    `caches`, each branch's calls through its step cache."""

    def step(
        latents: torch.Tensor,
        branch: Conditioning,
        sigma: torch.Tensor,
        control: StepControl | None = None,
    ) -> torch.Tensor:
        extra = {} if control is None else {"control": control}
        call = pipe.model.step_call(latents, sigma, branch, canvas, **extra)
        cache = None if caches is None else caches[next(i for i, b in enumerate(branches) if b is branch)]
        if not (pipe.cuda_graphs and call.graphable):
            with caching(cache):
                return pipe.model.run_step(*call.tensors, *call.static)
        return pipe._graphed(*call.tensors, static=call.static, cache=cache)

    return step


def step_caches(pipe: Pipeline, preset: CachePreset | None, branches: int) -> list[BranchCache] | None:
    """One step cache per CFG branch for `preset`, kept across requests (graphs hold their buffers), told
    which blocks it skips by the transformer's placement under a memory plan (streamed blocks)."""
    if preset is None:
        return None
    memory = pipe.memory
    schedule = None if memory is None else memory.placed[memory.profile.part(DENOISE).name]
    return [pipe._caches.setdefault((preset, b), BranchCache(preset, schedule)) for b in range(branches)]


def mask_crop(pipe: Pipeline, start: StartImage | None, canvas: object) -> MaskCrop | None:
    """The box a start request with `padding_mask_crop` is generated in (None without)."""
    if start is None or start.padding_mask_crop is None:
        return None
    return pipe.model.mask_crop(start.image, start.mask, canvas, start.padding_mask_crop)


def control_steps(
    control: Control,
    steps: int,
    latents: tuple[torch.Tensor, ...],
    positive: Conditioning,
    device: torch.device,
) -> list[StepControl]:
    """Each step's ControlNet input: the control images' latents, their scales at that step (FP32 device
    scalars, made at once), and the positive branch's conditioning."""
    table = torch.tensor(control.step_scales(steps), dtype=torch.float32).to(device)
    return [StepControl(latents, tuple(row.unbind()), positive) for row in table]


def decode(pipe: Pipeline, rows: torch.Tensor, canvas: object, fast: bool, crop: MaskCrop | None) -> Decoded:
    """A request's rows of final latents as images (a crop's box pasted back into its image), with the
    VAE's report of how it decoded them."""
    decoded = pipe.model.decode(rows, canvas, fast)
    if crop is None:
        return decoded
    images: list[PIL.Image.Image] = [crop.paste(image) for image in decoded.images]
    return Decoded(images, decoded.report)
