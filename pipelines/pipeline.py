"""The family-neutral pipeline: conditioning, the flow-matching denoise loop with true CFG and a CUDA-graph
step, decoding. It drives a `FamilyModel` (models/family.py) and never names a family.

For Qwen-Image it reproduces diffusers' `QwenImagePipeline` step for step (same seeds, schedule, CFG
rescale and decoding), so with `variant="reference"` its pixels equal diffusers' on the same weights.
"""

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import PIL.Image
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from qwen_image_fusion.models.cache_presets import CachePreset
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.family import (
    DEFAULT_SEQUENCE_LENGTH,
    CheckpointSpec,
    Conditioning,
    FamilyModel,
    StepControl,
)
from qwen_image_fusion.models.lora import MergeReport
from qwen_image_fusion.models.lora_files import LoraFile
from qwen_image_fusion.models.mask_crop import MaskCrop
from qwen_image_fusion.models.memory import DENOISE, ENCODE, Workload
from qwen_image_fusion.models.step_cache import BranchCache, caching
from qwen_image_fusion.pipelines.control import Control
from qwen_image_fusion.pipelines.cuda_graph import (
    MAX_GRAPHS,
    GraphedStep,
    cuda_graphs_enabled_by_env,
    cut_collectives_by_env,
)
from qwen_image_fusion.pipelines.generation_request import GenerationRequest, StartImage, resolve_request
from qwen_image_fusion.pipelines.load_options import LoadOptions
from qwen_image_fusion.pipelines.lora import LoadedLora, LoraSet
from qwen_image_fusion.pipelines.memory import GpuMemory, in_phase, plan_for
from qwen_image_fusion.pipelines.memory_plan import MemoryPlan
from qwen_image_fusion.pipelines.parallel import (
    ParallelPlan,
    Ranks,
    check_supported,
    join_ranks,
    resolve_plan,
)
from qwen_image_fusion.pipelines.presets import get_preset
from qwen_image_fusion.pipelines.sampling import (
    Step,
    branch_velocities,
    euler_loop,
    flow_timesteps,
    inpaint_blend,
    strength_timesteps,
)
from qwen_image_fusion.pipelines.variants import AUTO, Variant, get_variant, resolve_variant, variants_for

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


@dataclass
class RunInfo:
    """What one request's run did: seed, size, variant and seconds per stage."""

    seed: int | list[int]
    width: int
    height: int
    num_inference_steps: int  # the steps that ran (img2img: the `strength` share of those asked for)
    variant: str
    fusion_summary: str
    timings: dict[str, float] = field(default_factory=dict)
    preset: str = ""
    loras: str = ""  # the LoRAs that ran, with scales and mode ("" without LoRA)
    shared_by: int = 1  # requests that shared its denoising steps (their seconds are in each one's timings)
    cache: str = ""  # the step cache and the steps it skipped ("" without one)
    caption: str = ""  # the model's caption that stood for an empty prompt ("" when none did)
    fast_decode: bool = False  # the VAE's opt-in 2D decode was asked for (close, not identical)

    @property
    def ms_per_step(self) -> float:
        return 1000.0 * self.timings.get("denoising", 0.0) / max(self.num_inference_steps, 1)


@dataclass(frozen=True)
class Precision:
    """The dtypes a pipeline runs in: the transformer and text encoder (`dtype`) and the VAE, and why."""

    dtype: torch.dtype
    vae_dtype: torch.dtype
    reason: str

    def describe(self) -> str:
        names = str(self.dtype).removeprefix("torch."), str(self.vae_dtype).removeprefix("torch.")
        dtypes = names[0] if names[0] == names[1] else f"{names[0]} (VAE {names[1]})"
        return f"{dtypes}: {self.reason}"


def pick_device(device: str | torch.device | None) -> torch.device:
    """CUDA when available (or asked for), else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise InputError(f"device {device!r} is not a device: use cuda or cpu") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was requested but CUDA is not available on this machine")
    return device


def check_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype given as a name or a torch dtype (None: chosen for the device); InputError otherwise."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise InputError(f"unsupported dtype {dtype!r}: use bf16 or fp32")


CPU_DTYPE_ENV = "QWEN_IMAGE_CPU_DTYPE"


def cpu_dtype_override() -> str | None:
    """`QWEN_IMAGE_CPU_DTYPE` when set: the CPU defaults are picked as on a CPU with (`bf16`) or without
    (`fp32`) native BF16, whatever this CPU has; CI runs the dtype-dependent tests under both."""
    forced = os.environ.get(CPU_DTYPE_ENV, "")
    if forced and forced not in ("bf16", "fp32"):
        raise InputError(
            f"{CPU_DTYPE_ENV}={forced!r} is not bf16 or fp32 (unset: what this CPU computes natively)"
        )
    return forced or None


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes BF16 natively: every CUDA GPU we run on; a CPU with AVX-512 BF16 or AMX (or
    as `QWEN_IMAGE_CPU_DTYPE` says)."""
    if device.type != "cpu":
        return True
    forced = cpu_dtype_override()
    if forced is not None:
        return forced == "bf16"
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pick_precision(dtype: torch.dtype | None, device: torch.device, variant: Variant) -> Precision:
    """`dtype` when given, for every component. Else BF16 where the device computes it natively; on a CPU
    without native BF16 (BF16 convolutions and matmuls several times slower than FP32) the VAE runs in FP32,
    and so does the transformer unless its variant is defined in BF16 (contract and FP8 numerics)."""
    if dtype is not None:
        return Precision(dtype, dtype, "as asked (--dtype)")
    forced = cpu_dtype_override() if device.type == "cpu" else None
    if native_bf16(device):
        how = f"{CPU_DTYPE_ENV}=bf16: as on a CPU with native BF16" if forced else "computes BF16 natively"
        return Precision(torch.bfloat16, torch.bfloat16, f"{device.type} {how}")
    why = f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native BF16"
    if forced:
        why = f"{CPU_DTYPE_ENV}=fp32: as on a CPU with no native BF16"
    if variant.numerics == "contract":
        return Precision(
            torch.bfloat16, torch.float32, f"{why}; the {variant.name} variant is defined in BF16"
        )
    return Precision(torch.float32, torch.float32, why)


def pick_numerics(
    fp8_weights: bool, variant: str, device: torch.device, dtype: str | torch.dtype | None = None
) -> tuple[Variant, Precision]:
    """The variant `variant` resolves to and the dtypes it runs in on `device`: where BF16 is slow (a CPU
    without native BF16, no dtype given) `auto` prefers diffusers' arithmetic in FP32."""
    dtype = check_dtype(dtype)
    chosen = resolve_variant(variant, fp8_weights, prefer_reference=dtype is None and not native_bf16(device))
    return chosen, pick_precision(dtype, device, chosen)


class Pipeline:
    """A checkpoint of any registered family on one device; the variant picks numerics and FP8 fusion on
    shared weights, LoRAs stack on them, and a parallel plan shares each image with other ranks."""

    def __init__(
        self,
        model: FamilyModel,
        spec: CheckpointSpec,
        precision: Precision,
        variant: str | Variant = AUTO,
        memory: GpuMemory | None = None,
    ) -> None:
        self.model = model
        self.memory = memory  # where the weights live for a GPU-memory budget (None: all on the device)
        self.spec = spec
        self.model_name = spec.name
        self.defaults = spec.defaults
        self.size_multiple = spec.size_multiple
        self.precision = precision
        self.device, self.dtype = model.device, model.dtype
        self.last_run: RunInfo | None = None
        self.cuda_graphs = self.device.type == "cuda" and cuda_graphs_enabled_by_env()
        self._graphed = GraphedStep(model.run_step, cut_collectives=cut_collectives_by_env())
        self._caches: dict[tuple[CachePreset, int], BranchCache] = {}  # per preset and CFG branch
        self._limit_graphs()
        self.ranks: Ranks | None = None  # this process's part in a parallel plan (pipelines/parallel.py)
        self.lora = LoraSet(model.transformer, self.dtype, spec.family.convert_lora, device=self.device)
        self.set_variant(variant)

    @classmethod
    def load(cls, options: LoadOptions) -> "Pipeline":
        """Load a local diffusers-layout checkpoint of any registered family, or the embedded default
        (`options.model` None). Every option and config is checked before any weight is read. A parallel
        plan makes this process one rank of a launched group (refused before loading when it does not
        fit). On CUDA the weights are placed for `gpu_memory` (bytes or a size such as "24GiB"; default:
        what the device has free) and the largest request `workload` (default: the checkpoint's default
        size): see pipelines/memory_plan.py. On a CPU an explicit `gpu_memory` places them the same way,
        the CPU standing in for the device (what the CI tests run)."""
        plan = resolve_plan(options.parallel, options.model)
        device = pick_device(options.device)
        if plan is not None:
            device = join_ranks(device)
        spec = inspect_checkpoint(options.model)
        chosen, precision = pick_numerics(spec.fp8, options.variant, device, options.dtype)
        gpu_memory, workload = options.gpu_memory, options.workload
        planned = plan_for(spec, precision.dtype, precision.vae_dtype, device, gpu_memory, workload)
        if plan is not None and planned is not None and not planned[1].resident:
            raise InputError("weights streamed for a GPU-memory budget do not combine with several GPUs yet")
        host = planned is not None and not planned[1].resident  # load on the host, place from there
        model = spec.family.load(
            spec, precision.dtype, torch.device("cpu") if host else device, precision.vae_dtype
        )
        memory = None
        if planned is not None:
            model.device = device
            memory = GpuMemory.for_model(model, *planned)
        pipe = cls(model, spec, precision, chosen, memory)
        if plan is not None:
            pipe.set_parallel(plan)
        return pipe

    @classmethod
    def from_model(cls, model: FamilyModel, spec: CheckpointSpec, variant: str = AUTO) -> "Pipeline":
        """A pipeline around a model built in memory (training samples, random benchmark weights), with
        the spec its family gives it (`ModelFamily.spec_for`)."""
        precision = Precision(model.dtype, model.components.vae.dtype, "as built")
        return cls(model, spec, precision, variant)

    @property
    def components(self):
        return self.model.components

    @property
    def transformer(self) -> torch.nn.Module:
        return self.model.transformer

    @property
    def vae_scale_factor(self) -> int:
        return self.model.vae_scale_factor

    @property
    def loras(self) -> dict[str, LoadedLora]:
        return self.lora.loaded

    @property
    def lora_mode(self) -> str:
        return self.lora.mode

    @property
    def lora_merge(self) -> MergeReport | None:
        return self.lora.merge_report

    def available_variants(self) -> list[str]:
        """Variants these weights can run: FP8 ones for a ModelOpt FP8 checkpoint, BF16 ones otherwise."""
        return [v.name for v in variants_for(self.spec.fp8)]

    @property
    def variant(self) -> str:
        """The variant that runs (fp8-unfused where fp8-fused was asked and the gate fused nothing)."""
        return self._variant.name

    def set_variant(self, variant: str | Variant) -> None:
        """Switch numerics or FP8 fusion in place (re-running the gate); 'auto' picks the fastest path."""
        self._variant = variant if isinstance(variant, Variant) else resolve_variant(variant, self.spec.fp8)
        self._resync()

    def _resync(self) -> None:
        """After a variant or LoRA change: branch or merge the LoRAs, set every module's numerics, re-run the
        FP8 fusion gate, and drop the captured CUDA graphs."""
        variant = self._variant
        self.lora.sync()
        parts = self.model.denoise_parts().values()  # the transformer first, then e.g. a ControlNet
        for part in parts:
            part.set_numerics(variant.numerics)
        if variant.fp8_weights:
            reports = [part.post_load_weights(fuse=variant.fused) for part in parts]
            fused = reports[0].fused  # the transformer's gate names the variant (FP8_FUSION=0: unfused)
            self._variant = get_variant("fp8-fused" if fused else "fp8-unfused")
        self._drop_graphs()
        if self.memory is not None:
            self.memory.refresh()
            self._limit_graphs()

    def load_lora(self, path: str | Path | LoraFile, scale: float = 1.0, name: str | None = None) -> str:
        """Mount a LoRA file (any layout diffusers reads for this family) at `scale`; returns its name.
        Several LoRAs stack; the base weights are never reloaded (pipelines/lora.py)."""
        name = self.lora.load(path, scale, name)
        self._resync()
        return name

    def set_lora_scales(self, scales: dict[str, float]) -> None:
        """Change the scales of loaded LoRAs, by name (the same scales again change nothing)."""
        if self.lora.set_scales(scales):
            self._resync()

    def unload_lora(self, name: str | None = None) -> None:
        """Remove one LoRA (all with None); the layers it touched get their original weights back."""
        self.lora.unload(name)
        self._resync()

    def set_lora_mode(self, mode: str) -> None:
        """'branch' (LoRA beside each layer; FP8 stays fused with dual output) or 'merge' (folded into the
        weights: no extra GEMMs; FP8 weights requantized, originals kept on the host)."""
        self.lora.set_mode(mode)
        self._resync()

    def set_gpu_memory(self, gpu_memory: int | str | None, workload: Workload | None = None) -> None:
        """Place the weights for another GPU-memory budget (None: what the GPU has free) and largest request
        without reloading them; captured graphs are dropped. InputError when it cannot work, or when this
        pipeline plans no memory (a CPU pipeline loaded without a budget)."""
        if self.memory is None:
            raise InputError("this pipeline was loaded without a memory plan: load it with gpu_memory")
        self._drop_graphs()
        self.memory.replan(gpu_memory, workload)
        self._limit_graphs()

    def _drop_graphs(self) -> None:
        """Forget the captured CUDA graphs and the step caches' buffers they hold."""
        self._graphed.graphs.clear()
        self._caches.clear()

    def _limit_graphs(self, plan: MemoryPlan | None = None) -> None:
        """A plan that moves weights counts one captured graph's memory pool, and the buffers its steps
        keep, per CFG branch of its request (default: the largest it holds): keep no more."""
        plan = plan or (None if self.memory is None else self.memory.plan)
        count = MAX_GRAPHS if plan is None or plan.resident else plan.calls_per_step
        self._graphed.max_graphs = count
        self.model.keep_step_buffers(count)

    def set_parallel(self, plan: ParallelPlan | None) -> None:
        """Share each image with the other ranks as `plan` says (None: this process alone). Every rank
        calls it at the same point; captured graphs are dropped."""
        if plan is not None:
            check_supported(plan, self.spec)
        if self.ranks is not None:
            self.ranks.release()
        self.ranks = None if plan is None or plan.world_size == 1 else Ranks(plan, self.transformer)
        self._drop_graphs()

    def parallel_summary(self) -> str:
        """The parallel plan this process runs in, e.g. "CFG-2 x Ulysses-1 on 2 ranks (this is rank 0)"."""
        return "one process" if self.ranks is None else self.ranks.describe()

    def fusion_summary(self) -> str:
        """The fusion report: fused FP8 producer paths and why the others are not."""
        if not self.spec.fp8:
            return "FP8 norm+quant fusion: off (BF16 weights)"
        parts = self.model.denoise_parts()
        others = [
            f"{folder}: {part.fusion_report.summary()}"
            for folder, part in parts.items()
            if folder != "transformer"
        ]
        return "\n".join([self.transformer.fusion_report.summary(), *others])

    def default_size(self, images: list[PIL.Image.Image] | None = None) -> tuple[int, int]:
        """(width, height) of a request that gives none: what its input images suggest (Edit: the
        1024x1024-area size at the aspect of diffusers' chosen image), else the checkpoint's defaults."""
        suggested = self.model.default_size(images) if images else None
        return suggested or (self.defaults.width, self.defaults.height)

    def encode(
        self,
        prompts: list[str],
        max_sequence_length: int,
        copies: int = 1,
        images: list[PIL.Image.Image] | None = None,
    ) -> Conditioning:
        """One branch's conditioning, each prompt repeated `copies` times in a row."""
        return self.model.encode(prompts, max_sequence_length, images).repeat(copies)

    def request(self, prompt: str | list[str], **values: Any) -> GenerationRequest:
        """`resolve_request` for this checkpoint (its defaults and presets, the size its model suggests for
        input images, its loaded LoRAs): `generate`'s arguments but the callbacks and `output_type`."""
        return resolve_request(
            self.spec, prompt, suggest_size=self.model.default_size, loras=self.loras, **values
        )

    @torch.no_grad()
    def generate(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        width: int | None = None,
        height: int | None = None,
        num_inference_steps: int | None = None,
        true_cfg_scale: float | None = None,
        seed: int | list[int] | None = None,
        num_images_per_prompt: int = 1,
        max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
        on_step: Callable[[int, int], None] | None = None,
        progress: bool = False,
        preset: str | None = None,
        lora_scales: dict[str, float] | None = None,
        image: PIL.Image.Image | list[PIL.Image.Image] | None = None,
        output_type: str = "pil",
        cache: str | CachePreset | None = None,
        init_image: PIL.Image.Image | None = None,
        strength: float | None = None,
        mask_image: PIL.Image.Image | None = None,
        padding_mask_crop: int | None = None,
        control_image: PIL.Image.Image | list[PIL.Image.Image] | None = None,
        controlnet_conditioning_scale: float | list[float] | None = None,
        control_guidance_start: float = 0.0,
        control_guidance_end: float = 1.0,
        control_mode: str | None = None,
        control_mask: PIL.Image.Image | None = None,
        layers: int | None = None,
        resolution: int | None = None,
        use_en_prompt: bool = False,
        fast_decode: bool = False,
    ) -> list[PIL.Image.Image] | torch.Tensor:
        """Generate (or, with input `image`s, edit) images; see docs/API.md. `init_image` starts from an
        image (img2img, `strength` of the schedule reworking it), `mask_image` repaints only its white part
        (inpainting; an Edit checkpoint repaints it in its input `image`), `padding_mask_crop` generates
        only the mask's box, that many pixels wider, and pastes it back. `control_image`s guide a ControlNet
        checkpoint (each scaled by `controlnet_conditioning_scale`, over the `control_guidance_start`..`end`
        share of the steps; `control_mode="canny"` makes the edge map from a photo; an inpainting ControlNet
        repaints `control_mask`'s white part of its one control image). A Qwen-Image-Layered checkpoint
        decomposes `image` into `layers` RGBA layers (each image's in a row), at `resolution` (the side of a
        square of the output's area; default 640) or `width` x `height`; an empty prompt is its caption of
        the image (`use_en_prompt`: in English; the caption lands in `last_run.caption`). `fast_decode`
        runs the VAE's 2D form (opt-in: close to the exact decode, not identical; models/vae_decode.py).
        `seed` may give one seed per prompt: each prompt's images then start from its own seed's noise, as
        when generated alone. Details of the run land in `self.last_run`. `output_type="latent"` returns the
        final packed latents and skips decoding (as diffusers' pipelines do). One request through `run`."""
        request = self.request(
            prompt,
            negative_prompt=negative_prompt,
            width=width,
            height=height,
            num_inference_steps=num_inference_steps,
            true_cfg_scale=true_cfg_scale,
            seed=seed,
            num_images_per_prompt=num_images_per_prompt,
            max_sequence_length=max_sequence_length,
            preset=preset,
            lora_scales=lora_scales,
            image=image,
            cache=cache,
            init_image=init_image,
            strength=strength,
            mask_image=mask_image,
            padding_mask_crop=padding_mask_crop,
            control_image=control_image,
            controlnet_conditioning_scale=controlnet_conditioning_scale,
            control_guidance_start=control_guidance_start,
            control_guidance_end=control_guidance_end,
            control_mode=control_mode,
            control_mask=control_mask,
            layers=layers,
            resolution=resolution,
            use_en_prompt=use_en_prompt,
            fast_decode=fast_decode,
        )
        return self.run([request], on_step=on_step, progress=progress, output_type=output_type)[0].images

    @torch.no_grad()
    def run(
        self,
        requests: Sequence[GenerationRequest],
        slots: int | None = None,
        on_step: Callable[[int, int], None] | None = None,
        progress: bool = False,
        output_type: str = "pil",
    ) -> list["Generated"]:
        """The one way requests run: each request's images and RunInfo, in order (`last_run` is the last's).

        One request runs alone. Several (or `slots` above one) share denoising steps: they must agree on
        `batch_key`; their prompts are encoded in shared text-encoder calls of `slots` rows where the
        family can (its spec `shares_text_encoding`; else each alone), each is decoded alone, and those whose
        conditioning has the same shapes denoise as one batch of `slots` requests (default: as many as
        given), the free slots filled with copies of the first, so a request's bytes do not depend on its
        companions (kernels may compute a row differently at another row count): they equal the same
        request's in any batch of `slots`. Under a memory plan every phase runs inside it: the text encoder
        brought in, the request checked against the plan (at its batch's rows, and prompts per encoder call)
        and the VAE tiled when it must, the offloaded components prefetched after."""
        if output_type not in ("pil", "latent"):
            raise InputError(f"output_type {output_type!r} must be 'pil' or 'latent'")
        requests = list(requests)
        slots = len(requests) if slots is None else slots
        first = requests[0] if requests else None
        if first is None or slots < len(requests):
            raise InputError(f"{len(requests)} requests for a batch of {slots}")
        if slots > 1 and (first.batch_key is None or any(r.batch_key != first.batch_key for r in requests)):
            raise InputError("requests that share a batch must agree on everything but prompt and seed")
        if self.memory is not None:
            asked = [p for r in requests for p in (*r.prompts, *(r.negative_prompts if r.true_cfg else ()))]
            kept = self.model.prompt_tokens(asked)
            tokens = first.max_sequence_length if kept is None else max(kept, first.max_sequence_length)
            prompts = slots if self._shares_encoding(slots) else None  # per text-encoder call
            self._limit_graphs(self.memory.request(first.workload(slots * first.rows, tokens, prompts)))
        if first.cache is not None:
            self._check_cache()
        if first.control is not None:
            self._check_control()
        if first.lora_scales:
            self.set_lora_scales(dict(first.lora_scales))
        preset = get_preset(first.preset, self.spec.family.name)
        scheduler = self.model.scheduler if preset is None else preset.make_scheduler()
        seeds = [self._seed(r) for r in requests]
        encoded = self._encode(requests, slots)
        results: list[Generated | None] = [None] * len(requests)
        for group in _same_shapes(encoded):
            for index, generated in self._denoise_group(
                requests, encoded, seeds, group, slots, scheduler, on_step, progress, output_type
            ):
                results[index] = generated
        self.last_run = results[-1].info
        if self.memory is not None:
            self.memory.prefetch()  # the text encoder comes back while the caller looks at the images
        return results

    def _check_control(self) -> None:
        """InputError where ControlNet residuals are not built: blocks split over ranks (Ulysses)."""
        if self.ranks is not None and self.ranks.plan.ulysses > 1:
            summary = self.parallel_summary()
            raise InputError(f"ControlNet is not built for Ulysses sequence parallelism ({summary})")

    def _check_cache(self) -> None:
        """InputError where a step cache is not built: blocks split over ranks (Ulysses)."""
        if self.ranks is not None and self.ranks.plan.ulysses > 1:
            summary = self.parallel_summary()
            raise InputError(f"a step cache is not built for Ulysses sequence parallelism ({summary})")

    def _seed(self, request: GenerationRequest) -> int | list[int]:
        """The request's seed (a list: one per prompt); drawn when it has none, the same on every rank."""
        if request.seed is not None:
            return list(request.seed) if isinstance(request.seed, tuple) else request.seed
        seed = random.randrange(2**31)
        return seed if self.ranks is None else self.ranks.share_seed(seed)

    def _shares_encoding(self, slots: int) -> bool:
        """Whether a batch of `slots` encodes its prompts in shared calls (the family's spec says it can)."""
        return slots > 1 and self.spec.shares_text_encoding

    def _encode(self, requests: list[GenerationRequest], slots: int) -> list["_Encoded"]:
        """Each request's conditioning per CFG branch: a batch (`slots` above one) of a family whose spec
        `shares_text_encoding` in the family's shared calls of `slots` rows, else each request alone."""
        if self._shares_encoding(slots):
            return self._encode_together(requests, slots)
        encoded = []
        for request in requests:
            timer = _StageTimer(self.device)
            with in_phase(self.memory, ENCODE):
                encoded.append(self._branches(request))
            timer.lap("text_encoding")
            encoded[-1].timings.update(timer.timings)
        return encoded

    def _encode_together(self, requests: list[GenerationRequest], slots: int) -> list["_Encoded"]:
        """The batch's prompts, one CFG branch at a time, in `FamilyModel.encode_batch`'s calls of `slots`
        rows (`batch_key` holds each request of a batch to one prompt: one row each); each request's
        conditioning is its row, repeated per image, timed with the calls it shared."""
        first = requests[0]
        length, copies = first.max_sequence_length, first.num_images_per_prompt
        branches = [[r.prompts[0] for r in requests]]
        if first.true_cfg:
            branches.append([r.negative_prompts[0] for r in requests])
        timer = _StageTimer(self.device)
        with in_phase(self.memory, ENCODE):
            encoded = [self.model.encode_batch(prompts, length, slots) for prompts in branches]
        timer.lap("text_encoding")
        return [
            _Encoded([branch[i].repeat(copies) for branch in encoded], dict(timer.timings))
            for i in range(len(requests))
        ]

    def _branches(self, request: GenerationRequest) -> "_Encoded":
        """The request's conditioning per CFG branch (its prompts together, each repeated per image)."""
        n, length, images = request.num_images_per_prompt, request.max_sequence_length, list(request.images)
        prompts, caption = list(request.prompts), ""
        if self.spec.captions and request.captioned:
            caption = self.model.caption(images[0], request.width, request.height, request.use_en_prompt)
            prompts = [caption]
        branches = [self.encode(prompts, length, n, images)]
        if request.true_cfg:
            branches.append(self.encode(list(request.negative_prompts), length, n, images))
        return _Encoded(branches, caption=caption)

    def _denoise_group(
        self,
        requests: list[GenerationRequest],
        encoded: list["_Encoded"],
        seeds: list[int | list[int]],
        group: list[int],
        slots: int,
        scheduler: FlowMatchEulerDiscreteScheduler,
        on_step: Callable[[int, int], None] | None,
        progress: bool,
        output_type: str,
    ) -> list[tuple[int, "Generated"]]:
        """Requests `group` (indices into `requests`) denoised as one batch of `slots` (`slots` 1: alone),
        each decoded alone."""
        first = requests[group[0]]
        padded = group + [group[0]] * (slots - len(group)) if slots > 1 else group
        branches = encoded[group[0]].branches  # alone: the family's conditioning as it made it
        if len(padded) > 1:
            rows = [[encoded[i].branches[b] for i in padded] for b in range(len(branches))]
            branches = [type(parts[0]).stack(parts) for parts in rows]
        images = list(first.images)
        timer = _StageTimer(self.device)
        layers = {} if first.layers is None else {"layers": first.layers}
        canvas = self.model.canvas(first.width, first.height, images, len(first.prompts), **layers)
        if images:
            timer.lap("image_encoding")
        batch_seeds = seeds[group[0]] if slots <= 1 else [seeds[i] for i in padded]
        steps, scale = first.num_inference_steps, first.true_cfg_scale
        caches = self._step_caches(first.cache, len(branches))
        crop = self._mask_crop(first.start, canvas)
        latents = self.denoise(
            branches,
            canvas,
            steps,
            scale,
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
            rows = latents[position * first.rows : (position + 1) * first.rows] if slots > 1 else latents
            decode = _StageTimer(self.device)
            fast = requests[index].fast_decode
            out = rows if output_type == "latent" else self.model.decode(rows, canvas, fast)
            if crop is not None and output_type != "latent":
                out = [crop.paste(image) for image in out]
            decode.lap("decoding")
            request, own = requests[index], encoded[index].timings | shared | decode.timings
            info = RunInfo(
                seeds[index],
                request.width,
                request.height,
                request.steps_run,
                self.variant,
                self.fusion_summary(),
                own | {"total": sum(own.values())},
                preset=request.preset or "",
                loras=self.lora.summary(),
                shared_by=len(group),
                cache=cache_summary(first.cache, caches, position * first.rows, first.rows, first.steps_run),
                caption=encoded[index].caption,
                fast_decode=fast,
            )
            done.append((index, Generated(out, info)))
        return done

    def denoise(
        self,
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
        (true CFG); `canvas` is the model's geometry of the request (`model.canvas`); `seed` a list gives
        each prompt's rows their own seed; `scheduler` defaults to the checkpoint's; `caches`, one per
        branch, a step cache (reset here); `start` an image to start from, noised to the first step that
        runs (img2img), its unmasked part kept (inpainting), only `crop`'s box of it generated (its
        `padding_mask_crop`); `control` the control images of a ControlNet checkpoint. Returns the final
        packed latents."""
        scheduler = self.model.scheduler if scheduler is None else scheduler
        batch = branches[0].embeds.shape[0]
        seeds = seed if isinstance(seed, list) else [seed]
        rows = batch // len(seeds)
        after_step, step_controls = None, None
        sigmas, shift = self.model.sigmas(steps), self.model.time_shift(canvas)
        if control is not None:
            maps = list(control.images)
            parts = [self.model.control_start(maps, control.mask, canvas, rows, s) for s in seeds]
            latents = torch.cat([p.noise for p in parts])
            timesteps = flow_timesteps(scheduler, sigmas, latents.shape[1], self.device, shift)
            encoded = tuple(torch.cat(each) for each in zip(*(p.latents for p in parts), strict=True))
            step_controls = _step_controls(control, len(timesteps), encoded, branches[0], self.device)
        elif start is None:
            latents = torch.cat([self.model.initial_latents(canvas, rows, s) for s in seeds])
            timesteps = flow_timesteps(scheduler, sigmas, latents.shape[1], self.device, shift)
        else:
            parts = [self.model.image_start(start.image, start.mask, canvas, rows, s, crop) for s in seeds]
            image_latents, noise = torch.cat([p.latents for p in parts]), torch.cat([p.noise for p in parts])
            canvas = self.model.start_canvas(canvas, image_latents)
            flow_timesteps(scheduler, sigmas, noise.shape[1], self.device, shift)
            timesteps = strength_timesteps(scheduler, start.first_step(steps))
            latents = scheduler.scale_noise(image_latents, timesteps[:1].repeat(batch), noise)
            if start.mask is not None:
                mask = torch.cat([p.mask for p in parts])
                after_step = inpaint_blend(scheduler, timesteps, image_latents, noise, mask)
        for cache in caches or ():
            cache.reset()
        step = self._step(canvas, branches, caches)
        controls = iter(step_controls or ())

        def velocity(latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            cfg = None if self.ranks is None else self.ranks.cfg
            now = step if step_controls is None else partial(step, control=next(controls))
            velocities = branch_velocities(now, latents, sigma, branches, cfg)
            if len(velocities) == 1:
                return velocities[0]
            return self.model.combine_cfg(*velocities, true_cfg_scale)

        return euler_loop(scheduler, timesteps, latents, velocity, on_step, progress, after_step)

    def _mask_crop(self, start: StartImage | None, canvas: object) -> MaskCrop | None:
        """The box a start request with `padding_mask_crop` is generated in (None without)."""
        if start is None or start.padding_mask_crop is None:
            return None
        return self.model.mask_crop(start.image, start.mask, canvas, start.padding_mask_crop)

    def _step(
        self, canvas: object, branches: list[Conditioning], caches: list[BranchCache] | None = None
    ) -> Step:
        """The transformer call for one request's geometry: CUDA-graph replays on CUDA, eager elsewhere;
        with `caches`, each branch's calls through its step cache."""

        def step(
            latents: torch.Tensor,
            branch: Conditioning,
            sigma: torch.Tensor,
            control: StepControl | None = None,
        ) -> torch.Tensor:
            extra = {} if control is None else {"control": control}
            call = self.model.step_call(latents, sigma, branch, canvas, **extra)
            cache = None if caches is None else caches[next(i for i, b in enumerate(branches) if b is branch)]
            if not (self.cuda_graphs and call.graphable):
                with caching(cache):
                    return self.model.run_step(*call.tensors, *call.static)
            return self._graphed(*call.tensors, static=call.static, cache=cache)

        return step

    def _step_caches(self, preset: CachePreset | None, branches: int) -> list[BranchCache] | None:
        """One step cache per CFG branch for `preset`, kept across requests (graphs hold their buffers), told
        which blocks it skips by the transformer's placement under a memory plan (streamed blocks)."""
        if preset is None:
            return None
        schedule = None if self.memory is None else self.memory.placed[self.memory.profile.part(DENOISE).name]
        return [self._caches.setdefault((preset, b), BranchCache(preset, schedule)) for b in range(branches)]


def _step_controls(
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


class _StageTimer:
    """Wall-clock seconds per stage, synchronizing CUDA so each lap is real."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.timings: dict[str, float] = {}
        self.start = self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.timings[name] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


@dataclass
class Generated:
    """One request's images (or final packed latents) and what its run did."""

    images: list[PIL.Image.Image] | torch.Tensor
    info: RunInfo


@dataclass
class _Encoded:
    """A request's conditioning per CFG branch and the seconds it took."""

    branches: list[Conditioning]
    timings: dict[str, float] = field(default_factory=dict)
    caption: str = ""

    @property
    def shapes(self) -> tuple:
        return tuple(
            (tuple(b.embeds.shape), None if b.mask is None else tuple(b.mask.shape)) for b in self.branches
        )


def _same_shapes(encoded: list[_Encoded]) -> list[list[int]]:
    """Indices of requests grouped by the shapes of their conditioning (only equal shapes stack), in order."""
    groups: dict[tuple, list[int]] = {}
    for index, each in enumerate(encoded):
        groups.setdefault(each.shapes, []).append(index)
    return list(groups.values())


_CACHE: dict[LoadOptions, Pipeline] = {}


def cache_summary(
    preset: CachePreset | None, caches: list[BranchCache] | None, first_row: int, rows: int, steps: int
) -> str:
    """RunInfo's line for a request's rows `first_row`.. of a denoise loop run with step `caches`: the
    preset and, per CFG branch this process ran (a CFG-parallel rank runs one), the steps whose middle
    blocks it skipped (mean over the request's rows)."""
    if preset is None or not caches:
        return ""
    names = ["positive", "negative"] if len(caches) == 2 else [""]
    parts = []
    for name, cache in zip(names, caches, strict=True):
        skipped = cache.skipped[first_row : first_row + rows]
        if skipped:
            parts.append(f"{sum(skipped) / len(skipped):g} of {steps}" + (f" ({name})" if name else ""))
    return f"{preset.name}: middle blocks skipped in {', '.join(parts)} steps"


def load_pipeline(
    model: str | Path | None = None,
    variant: str = AUTO,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    parallel: ParallelPlan | str | None = None,
    gpu_memory: int | str | None = None,
    workload: Workload | None = None,
) -> Pipeline:
    """A new pipeline for `model` (None: the embedded default); the options of `LoadOptions`
    (docs/API.md)."""
    return Pipeline.load(LoadOptions(model, variant, device, dtype, parallel, gpu_memory, workload))


def generate(
    prompt: str | list[str],
    model: str | Path | None = None,
    variant: str = AUTO,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    parallel: ParallelPlan | str | None = None,
    gpu_memory: int | str | None = None,
    **kwargs,
) -> list[PIL.Image.Image]:
    """One-call generation (`Pipeline.generate`'s arguments); keeps one pipeline per load options."""
    options = LoadOptions(model, variant, device, check_dtype(dtype), parallel, gpu_memory)
    if options not in _CACHE:
        _CACHE[options] = Pipeline.load(options)
    return _CACHE[options].generate(prompt, **kwargs)
