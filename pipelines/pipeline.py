"""The family-neutral pipeline: one checkpoint of any registered family loaded on one device, with its
state (variant and FP8 fusion, LoRAs, memory plan, parallel ranks, captured CUDA graphs) and the one-call
API. It drives a `FamilyModel` (models/family.py) and never names a family; a request's stages live in
pipelines/stages.py and the loop that runs them in pipelines/request_loop.py.

For Qwen-Image it reproduces diffusers' `QwenImagePipeline` step for step (same seeds, schedule, CFG
rescale and decoding), so with `variant="reference"` its pixels equal diffusers' on the same weights.
"""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import PIL.Image
import torch

from qwen_image_fusion.models.cache_presets import CachePreset
from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import DEFAULT_SEQUENCE_LENGTH, CheckpointSpec, Conditioning, FamilyModel
from qwen_image_fusion.models.lora import MergeReport
from qwen_image_fusion.models.lora_files import LoraFile
from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.models.nvfp4 import check_w4a4, set_nvfp4_activations, w4a4_target_refusal
from qwen_image_fusion.models.step_cache import BranchCache
from qwen_image_fusion.pipelines.cuda_graph import (
    MAX_GRAPHS,
    GraphedStep,
    cuda_graphs_enabled_by_env,
    cut_collectives_by_env,
)
from qwen_image_fusion.pipelines.generation_request import GenerationRequest, resolve_request
from qwen_image_fusion.pipelines.lora import LoadedLora, LoraSet
from qwen_image_fusion.pipelines.memory import GpuMemory
from qwen_image_fusion.pipelines.memory_plan import MemoryPlan
from qwen_image_fusion.pipelines.options import OPTION
from qwen_image_fusion.pipelines.parallel import (
    ParallelPlan,
    Ranks,
    check_supported,
)
from qwen_image_fusion.pipelines.precision import Precision
from qwen_image_fusion.pipelines.request_loop import run_requests
from qwen_image_fusion.pipelines.run_info import Generated, RunInfo
from qwen_image_fusion.pipelines.variants import AUTO, Variant, get_variant, resolve_variant, variants_for


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
        """Variants these weights can run here: the FP8 or NVFP4 ones for such a ModelOpt export (W4A4 where
        the device has FP4 tensor cores, or on the CPU), else BF16's."""
        runs_w4a4 = not w4a4_target_refusal(self.device)
        return [v.name for v in variants_for(self.spec.weights) if runs_w4a4 or not v.w4a4]

    @property
    def variant(self) -> str:
        """The variant that runs (fp8-unfused where fp8-fused was asked and the gate fused nothing)."""
        return self._variant.name

    def set_variant(self, variant: str | Variant) -> None:
        """Switch numerics or FP8 fusion in place (re-running the gate); 'auto' picks the fastest path."""
        chosen = variant if isinstance(variant, Variant) else resolve_variant(variant, self.spec.weights)
        if chosen.w4a4:
            check_w4a4(self.device)  # before anything changes
        self._variant = chosen
        self._resync()

    def _resync(self) -> None:
        """After a variant or LoRA change: branch or merge the LoRAs, set every module's numerics, re-run the
        FP8 fusion gate, and drop the captured CUDA graphs."""
        variant = self._variant
        self.lora.sync()
        parts = self.model.denoise_parts().values()  # the transformer first, then e.g. a ControlNet
        for part in parts:
            part.set_numerics(variant.numerics)
        if variant.weights is WeightFormat.NVFP4:
            for part in parts:
                set_nvfp4_activations(part, variant.w4a4, self.device)
        if variant.weights is not WeightFormat.BF16:
            reports = [part.post_load_weights(fuse=variant.fused) for part in parts]
        if variant.weights is WeightFormat.FP8 or variant.w4a4:
            fused = reports[0].fused  # the transformer's gate names the variant (FP8_FUSION=0: unfused)
            kind = "fp8" if variant.weights is WeightFormat.FP8 else "nvfp4-w4a4"
            self._variant = get_variant(f"{kind}-fused" if fused else f"{kind}-unfused")
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
        if self.spec.weights is WeightFormat.BF16:
            return "FP8 norm+quant fusion: off (BF16 weights)"
        if self._variant.name == "nvfp4":
            return "NVFP4 weight path: BF16 activations, weights dequantized in the GEMM (no producer fusion)"
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
        values = {name: value for name, value in locals().items() if name in OPTION and name != "prompt"}
        request = self.request(prompt, **values)
        return self.run([request], on_step=on_step, progress=progress, output_type=output_type)[0].images

    @torch.no_grad()
    def run(
        self,
        requests: Sequence[GenerationRequest],
        slots: int | None = None,
        on_step: Callable[[int, int], None] | None = None,
        progress: bool = False,
        output_type: str = "pil",
    ) -> list[Generated]:
        """The one way requests run: each request's images and RunInfo, in order (`last_run` is the last's).

        One request runs alone. Several (or `slots` above one) share denoising steps: they must agree on
        `batch_key`; their prompts are encoded in shared text-encoder calls of `slots` rows where the
        family can (its spec `shares_text_encoding`; else each alone), each is decoded alone, and those whose
        conditioning has the same shapes denoise as one batch of `slots` requests (default: as many as
        given), the free slots filled with copies of the first, so a request's bytes do not depend on its
        companions (kernels may compute a row differently at another row count): they equal the same
        request's in any batch of `slots`. A request's `lora_scales` are in force for its call only. Under a
        memory plan every phase runs inside it: the text encoder brought in, the request checked against
        the plan (at its batch's rows, and prompts per encoder call) and the VAE tiled when it must, the
        offloaded components prefetched after."""
        return run_requests(self, requests, slots, on_step, progress, output_type)

    def use_call_lora_scales(self, scales: dict[str, float]) -> None:
        """Put a call's LoRA scales in force over the lasting ones (re-syncing only when they change)."""
        if self.lora.apply_for_call(scales):
            self._resync()
