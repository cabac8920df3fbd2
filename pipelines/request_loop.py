"""The one way requests run on a pipeline: checked against its state (memory plan, ranks), each request's
LoRA scales set for its call, prompts encoded, requests that agree denoised as one batch, each decoded
alone, and each one's `RunInfo` filled by the stages that ran it."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from diffusers import FlowMatchEulerDiscreteScheduler

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines.generation_request import GenerationRequest
from qwen_image_fusion.pipelines.presets import get_preset
from qwen_image_fusion.pipelines.run_info import Generated, RunInfo, StageTimer, cache_report
from qwen_image_fusion.pipelines.stages import (
    Encoded,
    Pipeline,
    decode,
    denoise,
    encode_each,
    encode_together,
    mask_crop,
    step_caches,
)

OUTPUT_TYPES = ("pil", "latent")


def run_requests(
    pipe: Pipeline,
    requests: Sequence[GenerationRequest],
    slots: int | None = None,
    on_step: Callable[[int, int], None] | None = None,
    progress: bool = False,
    output_type: str = "pil",
) -> list[Generated]:
    """Each request's images and RunInfo, in order (`pipe.last_run` is the last's); see `Pipeline.run`."""
    if output_type not in OUTPUT_TYPES:
        raise InputError(f"output_type {output_type!r} must be 'pil' or 'latent'", "output_type")
    requests = list(requests)
    slots = len(requests) if slots is None else slots
    first = requests[0] if requests else None
    if first is None or slots < len(requests):
        raise InputError(f"{len(requests)} requests for a batch of {slots}")
    if slots > 1 and (first.batch_key is None or any(r.batch_key != first.batch_key for r in requests)):
        raise InputError("requests that share a batch must agree on everything but prompt and seed")
    shared_encoding = slots > 1 and pipe.spec.shares_text_encoding
    if pipe.memory is not None:
        asked = [p for r in requests for p in (*r.prompts, *(r.negative_prompts if r.true_cfg else ()))]
        kept = pipe.model.prompt_tokens(asked)
        tokens = first.max_sequence_length if kept is None else max(kept, first.max_sequence_length)
        prompts = slots if shared_encoding else None  # per text-encoder call
        pipe._limit_graphs(pipe.memory.request(first.workload(slots * first.rows, tokens, prompts)))
    if first.cache is not None:
        check_split_blocks(pipe, "a step cache is")
    if first.control is not None:
        check_split_blocks(pipe, "ControlNet is")
    pipe.use_call_lora_scales(dict(first.lora_scales))
    preset = get_preset(first.preset, pipe.spec.family.name)
    scheduler = pipe.model.scheduler if preset is None else preset.make_scheduler()
    seeds = [request_seed(pipe, r) for r in requests]
    encoded = encode_together(pipe, requests, slots) if shared_encoding else encode_each(pipe, requests)
    results: list[Generated | None] = [None] * len(requests)
    for group in same_shapes(encoded):
        for index, generated in denoise_group(
            pipe, requests, encoded, seeds, group, slots, scheduler, on_step, progress, output_type
        ):
            results[index] = generated
    pipe.last_run = results[-1].info
    if pipe.memory is not None:
        pipe.memory.prefetch()  # the text encoder comes back while the caller looks at the images
    return results


def check_split_blocks(pipe: Pipeline, what: str) -> None:
    """InputError where `what` (a step cache, ControlNet residuals) is not built: blocks split over ranks
    (Ulysses)."""
    if pipe.ranks is not None and pipe.ranks.plan.ulysses > 1:
        raise InputError(f"{what} not built for Ulysses sequence parallelism ({pipe.parallel_summary()})")


def request_seed(pipe: Pipeline, request: GenerationRequest) -> int | list[int]:
    """The request's seed (a list: one per prompt); drawn when it has none, the same on every rank."""
    if request.seed is not None:
        return list(request.seed) if isinstance(request.seed, tuple) else request.seed
    seed = random.randrange(2**31)
    return seed if pipe.ranks is None else pipe.ranks.share_seed(seed)


def same_shapes(encoded: list[Encoded]) -> list[list[int]]:
    """Indices of requests grouped by the shapes of their conditioning (only equal shapes stack), in order."""
    groups: dict[tuple, list[int]] = {}
    for index, each in enumerate(encoded):
        groups.setdefault(each.shapes, []).append(index)
    return list(groups.values())


def denoise_group(
    pipe: Pipeline,
    requests: list[GenerationRequest],
    encoded: list[Encoded],
    seeds: list[int | list[int]],
    group: list[int],
    slots: int,
    scheduler: FlowMatchEulerDiscreteScheduler,
    on_step: Callable[[int, int], None] | None,
    progress: bool,
    output_type: str,
) -> list[tuple[int, Generated]]:
    """Requests `group` (indices into `requests`) denoised as one batch of `slots` (`slots` 1: alone), each
    decoded alone."""
    first = requests[group[0]]
    padded = group + [group[0]] * (slots - len(group)) if slots > 1 else group
    branches = encoded[group[0]].branches  # alone: the family's conditioning as it made it
    if len(padded) > 1:
        rows = [[encoded[i].branches[b] for i in padded] for b in range(len(branches))]
        branches = [type(parts[0]).stack(parts) for parts in rows]
    images = list(first.images)
    timer = StageTimer(pipe.device)
    layers = {} if first.layers is None else {"layers": first.layers}
    canvas = pipe.model.canvas(first.width, first.height, images, len(first.prompts), **layers)
    if images:
        timer.lap("image_encoding")
    batch_seeds = seeds[group[0]] if slots <= 1 else [seeds[i] for i in padded]
    caches = step_caches(pipe, first.cache, len(branches))
    crop = mask_crop(pipe, first.start, canvas)
    latents = denoise(
        pipe,
        branches,
        canvas,
        first.num_inference_steps,
        first.true_cfg_scale,
        batch_seeds,
        on_step,
        progress,
        scheduler,
        caches,
        first.start,
        first.control,
        crop,
    )
    timer.lap("denoising")
    shared = dict(timer.timings)
    done = []
    for position, index in enumerate(group):
        request = requests[index]
        rows = latents[position * first.rows : (position + 1) * first.rows] if slots > 1 else latents
        decode_timer = StageTimer(pipe.device)
        if output_type == "latent":
            out, report = rows, None
        else:
            decoded = decode(pipe, rows, canvas, request.fast_decode, crop)
            out, report = decoded.images, decoded.report
        decode_timer.lap("decoding")
        own = encoded[index].timings | shared | decode_timer.timings
        info = RunInfo(
            seeds[index],
            request.width,
            request.height,
            request.steps_run,
            pipe.variant,
            pipe.fusion_summary(),
            own | {"total": sum(own.values())},
            preset=request.preset or "",
            loras=pipe.lora.summary(),
            shared_by=len(group),
            cache=cache_report(first.cache, caches, position * first.rows, first.rows, first.steps_run),
            caption=encoded[index].caption,
            decode=report,
        )
        done.append((index, Generated(out, info)))
    return done
