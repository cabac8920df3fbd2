"""The model-family seam: what a model family provides, and the types it shares with the pipeline.

A family (Qwen-Image, and the ones to come) is a package under `models/` plus one line in
`models/families.py`, chosen by the `_class_name` of a checkpoint's `model_index.json`. It provides:
- `ModelFamily.inspect`: its configs read and checked without torch, before any weight (the size
  multiple, attention heads, FP8 or not, generation defaults, how many images a request may carry);
- `ModelFamily.load`: its components loaded into a `FamilyModel`, the object the family-neutral
  pipeline drives: text (and image) conditioning, latent geometry and noise, one transformer step (with
  its tensors and static arguments, so the pipeline can capture it in a CUDA graph), the CFG
  combination, decoding, its quantization recipe (BF16 fallback, linears sharing an input) and what
  `info` says about it. Its transformer carries the fusion paths (`post_load_weights`, `set_numerics`).
Shared by all families, and never naming one: the sampling loop and CUDA-graph step, the FP8 loader
and fusion gate, LoRA, parallel plans, quantize, eval, the CLI and the UI (docs/DESIGN.md §8).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.presets import Preset

if TYPE_CHECKING:
    import PIL.Image
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from torch import nn

    from qwen_image_fusion.models.mask_crop import MaskCrop
    from qwen_image_fusion.models.vae_decode import DecodeReport

DEFAULTS_KEY = "_generation_defaults"  # model_index.json: this checkpoint's own defaults (diffusers skips _)
DEFAULT_TRUE_CFG_SCALE = 4.0
MAX_SEQUENCE_LENGTH = 1024  # text tokens a prompt may keep (diffusers' Qwen-Image pipelines)
DEFAULT_SEQUENCE_LENGTH = 512


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults a checkpoint suggests for a request; `negative_prompt` None: true CFG off unless asked."""

    width: int = 1024
    height: int = 1024
    num_inference_steps: int = 50
    true_cfg_scale: float = DEFAULT_TRUE_CFG_SCALE
    negative_prompt: str | None = None

    def with_metadata(self, metadata: object, where: Path) -> GenerationDefaults:
        """These defaults overridden by a checkpoint's `_generation_defaults` entry (each field checked)."""
        if metadata is None:
            return self
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{where}: {DEFAULTS_KEY} must be a JSON object")
        known = {f.name: f for f in fields(self)}
        unknown = sorted(set(metadata) - set(known))
        if unknown:
            raise CheckpointError(f"{where}: {DEFAULTS_KEY} has unknown fields {unknown}")
        for name, value in metadata.items():
            if not _valid_default(name, value):
                raise CheckpointError(f"{where}: {DEFAULTS_KEY}.{name} = {value!r} is not valid")
        return replace(self, **metadata)

    def as_metadata(self) -> dict[str, Any]:
        """The `_generation_defaults` entry that gives back these defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _valid_default(name: str, value: object) -> bool:
    if name == "negative_prompt":
        return value is None or isinstance(value, str)
    if name == "true_cfg_scale":
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def calculate_dimensions(target_area: float, ratio: float) -> tuple[int, int]:
    """(width, height) with about `target_area` pixels at aspect `ratio`, each rounded to a multiple of 32
    (diffusers' `calculate_dimensions`)."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


@dataclass(frozen=True)
class CheckpointSpec:
    """What a checkpoint's configs say, read without torch before any weight."""

    family: ModelFamily
    directory: Path
    name: str  # what reports call the model: its directory, or the embedded default's name
    attention_heads: int
    size_multiple: int  # image sides must be multiples of this (VAE scale x latent packing)
    defaults: GenerationDefaults
    weights: WeightFormat  # how the transformer's linears are stored: BF16, ModelOpt FP8 or NVFP4
    max_images: int = 0  # input images a request may carry (0: text to image only)
    images_required: bool = False  # the model cannot generate without an input image
    starts_from_image: bool = False  # img2img and inpainting: a request may start from an image (+ mask)
    inpaints_input: bool = False  # inpainting edits: a mask repaints part of the one input image (the start)
    takes_control: bool = False  # it holds a ControlNet: a request may carry control images
    control_inpaints: bool = False  # an inpainting ControlNet: one control image and its mask
    decomposes: bool = False  # Qwen-Image-Layered: a request's image comes back as `layers` RGBA layers
    captions: bool = False  # an empty prompt is filled with the model's caption of the input image
    sequence_parallel: bool = True  # its transformer declares a Ulysses plan (models/sequence_parallel.py)
    shares_text_encoding: bool = False  # a batch's prompts are encoded in shared calls (`encode_batch`)
    fast_decode: bool = False  # its VAE has the opt-in 2D single-frame decode (models/vae_decode.py)

    @property
    def fp8(self) -> bool:
        """The transformer is a ModelOpt FP8 export."""
        return self.weights is WeightFormat.FP8


@dataclass(frozen=True)
class QuantRecipe:
    """How `quantize` treats a family's transformer: module globs kept in BF16 (DESIGN §3) and the groups of
    sibling linears that read one activation and so share one input scale (Q/K/V of a stream)."""

    bf16_fallback: tuple[str, ...]
    shared_inputs: tuple[tuple[str, ...], ...]
    all_blocks_fp8: tuple[str, ...]  # the fallback that quantizes every block linear (benchmarks, tests)
    outside_blocks: tuple[str, ...]  # every linear outside the blocks (NVFP4's fallback adds edge blocks)
    weight_only: tuple[str, ...] = ()  # fallback globs `quantize --fp8-modulation` stores FP8 weight-only


@dataclass(frozen=True)
class Conditioning:
    """One CFG branch's prompt embeddings [B, L, H] and padding mask [B, L] (None when nothing is padded)."""

    embeds: torch.Tensor
    mask: torch.Tensor | None

    def repeat(self, copies: int) -> Conditioning:
        """Each prompt `copies` times in a row (diffusers' `num_images_per_prompt` order)."""
        batch, seq, _ = self.embeds.shape
        embeds = self.embeds.repeat(1, copies, 1).view(batch * copies, seq, -1)
        mask = None if self.mask is None else self.mask.repeat(1, copies).view(batch * copies, seq)
        return Conditioning(embeds, mask)

    @classmethod
    def stack(cls, parts: list[Conditioning]) -> Conditioning:
        """Several requests' conditionings of equal shapes as one batch, rows in order."""
        import torch

        masks = [p.mask for p in parts]
        mask = None if all(m is None for m in masks) else torch.cat(masks)
        return Conditioning(torch.cat([p.embeds for p in parts]), mask)


@dataclass(frozen=True)
class ImageStart:
    """Where img2img and inpainting start, for a request's rows: the start image's packed latents and the
    noise [B, tokens, C], and the mask packed like them (1: repaint, 0: keep; None: all of it may change)."""

    latents: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class ControlStart:
    """Where a ControlNet request starts, for its rows: each control image's packed latents [B, tokens, C]
    and the noise."""

    latents: tuple[torch.Tensor, ...]
    noise: torch.Tensor


@dataclass(frozen=True)
class StepControl:
    """A ControlNet's part of one step: each control image's packed latents, its conditioning scale at this
    step (an FP32 device scalar, 0 outside its guidance range), and the positive branch's conditioning,
    which the ControlNet reads in every CFG branch (as diffusers' ControlNet pipelines do)."""

    latents: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    positive: Conditioning


@dataclass(frozen=True)
class StepCall:
    """One transformer step as the pipeline runs it: `FamilyModel.run_step(*tensors, *static)`, where
    `static` (hashable) and the tensors' shapes key a captured CUDA graph. `graphable` False runs it eagerly
    (e.g. a first step that fills a cache the later, captured steps read)."""

    tensors: tuple[torch.Tensor | None, ...]
    static: tuple
    graphable: bool = True


@dataclass(frozen=True)
class Decoded:
    """A run's decoded images and how the VAE decoded them (the decode stage's own report)."""

    images: list[PIL.Image.Image]
    report: DecodeReport


@runtime_checkable
class FusionBlock(Protocol):
    """A transformer block with fused producer paths: each names its producer and consumers, and the block
    decides once, after the weights are loaded, which run fused (models/fusion.py: the gate's reasons)."""

    def producer_paths(self) -> dict[str, tuple[Any, list[tuple[str, nn.Module]]]]:
        """{path name: (its producer, its consumers (name, linear))}; names ending `_hidden` are MLP paths."""
        ...

    def post_load_weights(self, fuse: bool, prefix: str) -> list[Any]:
        """The gate's decision (qwen_image_fusion.models.fusion.PathDecision) for each of its paths, fusing
        where allowed."""
        ...


@runtime_checkable
class FamilyTransformer(Protocol):
    """The transformer's part of the family contract, what the shared machinery calls: its numerics
    (`set_numerics`: reference or contract, for every numerics-aware module), the FP8 fusion gate decided once
    after loading (`post_load_weights`, over its `transformer_blocks`, each a `FusionBlock`; it returns its
    qwen_image_fusion.models.fusion.FusionReport and keeps it as `fusion_report`), whether it holds ModelOpt
    FP8 weights, and the checkpoint's config (diffusers' parameter names; `config.num_attention_heads`...)."""

    config: Any
    transformer_blocks: nn.ModuleList

    @property
    def is_fp8(self) -> bool: ...

    def set_numerics(self, numerics: Any) -> None: ...

    def post_load_weights(self, fuse: bool | None = None) -> Any: ...


class FamilyModel(ABC):
    """A loaded checkpoint of one family: its components and the hooks the shared pipeline drives.

    `latents` are the family's packed target latents [B, tokens, channels]; a `canvas` is whatever the
    family needs to know about one request's geometry (from `canvas`), passed back to each hook."""

    transformer: FamilyTransformer
    components: Any
    device: torch.device  # where it computes (a memory plan may load the weights on the host first)
    dtype: torch.dtype
    quantization: QuantRecipe

    @abstractmethod
    def encode(
        self, prompts: list[str], max_sequence_length: int, images: list[PIL.Image.Image] | None = None
    ) -> Conditioning:
        """The conditioning of one CFG branch for `prompts` (each seeing the request's input `images`)."""

    def encode_batch(self, prompts: list[str], max_sequence_length: int, rows: int) -> list[Conditioning]:
        """For a family whose spec `shares_text_encoding`: one CFG branch's conditioning of each of a batch's
        `prompts` (one per request), from encoder calls of a shape that depends only on `rows` (the batch's
        fixed size) and each prompt's own tokens, so a prompt's bytes do not depend on its companions; each
        shaped as `encode([prompt], ...)` shapes it."""
        raise NotImplementedError(f"{type(self).__name__} encodes each request alone")

    @abstractmethod
    def canvas(
        self, width: int, height: int, images: list[PIL.Image.Image] | None = None, prompts: int = 1
    ) -> Any:
        """The latent geometry of a `width` x `height` request (and its input images' latents, if any, for a
        request of `prompts` prompts). A family whose spec `decomposes` also takes `layers`: the RGBA
        layers each image comes back as."""

    def default_size(self, images: list[PIL.Image.Image]) -> tuple[int, int] | None:
        """(width, height) a request with these input images defaults to; None: the checkpoint's defaults."""
        return None

    def sigmas(self, steps: int) -> np.ndarray:
        """The sigma grid of `steps` steps, before the scheduler's shift (diffusers' Qwen-Image default)."""
        return np.linspace(1.0, 1 / steps, steps)

    def caption(self, image: PIL.Image.Image, width: int, height: int, english: bool) -> str:
        """For a family whose spec `captions`: its vision-language model's caption of `image` at the output
        size, in English or Chinese (`english` False), as its diffusers pipeline writes one."""
        raise NotImplementedError(f"{type(self).__name__} does not caption images")

    def time_shift(self, canvas: Any) -> float | None:
        """The scheduler's dynamic shift `mu` for this canvas; None: diffusers' Qwen-Image rule, from the
        target's token count and the scheduler's config."""
        return None

    @abstractmethod
    def initial_latents(self, canvas: Any, batch: int, seed: int) -> torch.Tensor:
        """Seeded starting noise for `batch` images, packed, as diffusers draws it."""

    def image_start(
        self,
        image: PIL.Image.Image,
        mask: PIL.Image.Image | None,
        canvas: Any,
        batch: int,
        seed: int,
        crop: MaskCrop | None = None,
    ) -> ImageStart:
        """For a family whose spec `starts_from_image` or `inpaints_input`: `image` (and `mask`) at the
        canvas's size (with a `crop`: its box of `crop.image`), its latents and the noise for `batch` images
        drawn from one seeded generator as the family's diffusers img2img and inpainting pipelines draw
        them."""
        raise NotImplementedError(f"{type(self).__name__} does not start from an image")

    def mask_crop(self, image: PIL.Image.Image, mask: PIL.Image.Image, canvas: Any, pad: int) -> MaskCrop:
        """diffusers' `padding_mask_crop` for an inpainting request: the box around `mask`'s white part
        (`pad` pixels more, widened to the canvas's aspect) and the image and mask the generated box is
        pasted back onto, as the family's diffusers inpainting pipeline finds them."""
        raise NotImplementedError(f"{type(self).__name__} does not inpaint")

    def start_canvas(self, canvas: Any, latents: torch.Tensor) -> Any:
        """The canvas the steps of a request that starts from these packed start `latents` run on: `canvas`
        itself, unless the family's steps read the start (an inpainting edit's reference latents)."""
        return canvas

    def control_start(
        self,
        images: list[PIL.Image.Image],
        mask: PIL.Image.Image | None,
        canvas: Any,
        batch: int,
        seed: int,
    ) -> ControlStart:
        """For a family whose spec `takes_control`: the control `images` at the canvas's size, their latents
        (with an inpainting ControlNet: the image with its `mask`'s part blanked, and the mask) and the noise
        for `batch` images, drawn as the family's diffusers ControlNet pipelines draw them."""
        raise NotImplementedError(f"{type(self).__name__} holds no ControlNet")

    @abstractmethod
    def step_call(
        self, latents: torch.Tensor, sigma: torch.Tensor, branch: Conditioning, canvas: Any
    ) -> StepCall:
        """The tensors and static arguments of one transformer step for one branch (a family that
        `takes_control` also takes `control: StepControl | None`, given only for a request with control)."""

    @abstractmethod
    def run_step(self, *args: Any) -> torch.Tensor:
        """The velocity of the target latents: `run_step(*call.tensors, *call.static)`."""

    @abstractmethod
    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """True CFG from the two branches' velocities, as the family's diffusers pipeline combines them."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, canvas: Any, fast: bool = False) -> Decoded:
        """Images from final latents, a row's in a run (a family that `decomposes`: each row's layers), and
        how they were decoded; `fast` (a spec that has `fast_decode`): the VAE's opt-in 2D form, close to
        exact, not identical."""

    def prompt_tokens(self, prompts: list[str]) -> int | None:
        """Tokens of the longest of `prompts`, for a family that keeps every token of a prompt (a memory
        plan's request check counts them); None where prompts are cut to `max_sequence_length`."""
        return None

    def denoise_parts(self) -> dict[str, nn.Module]:
        """The modules that run in each denoising step, by checkpoint folder: the transformer (and e.g. a
        ControlNet). `quantize` calibrates them and writes each in FP8; a variant sets their numerics and
        fusion gates."""
        return {"transformer": self.transformer}

    def keep_step_buffers(self, count: int) -> None:  # noqa: B027 (optional hook: most keep nothing)
        """Keep the buffers the steps reuse across requests (e.g. a KV cache per CFG branch and request
        shape) for at most `count` shapes, as the pipeline keeps that many captured graphs: a memory plan
        counts one per CFG branch. Nothing to keep by default."""

    @abstractmethod
    def describe(self) -> list[str]:
        """Lines for `qwen-image info`: the components and the transformer's shape."""

    @abstractmethod
    def save(self, directory: Path, skip: tuple[str, ...], defaults: GenerationDefaults) -> None:
        """Write the components (but those in `skip`) as a diffusers-layout checkpoint with `defaults`."""

    @property
    def scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        return self.components.scheduler


class ModelFamily(ABC):
    """A model family: the `model_index.json` classes it serves, how it reads and how it loads them, and the
    generation presets made for its checkpoints."""

    name: str
    pipeline_classes: tuple[str, ...]
    presets: tuple[Preset, ...] = ()

    @abstractmethod
    def inspect(self, directory: Path, name: str) -> CheckpointSpec:
        """Read and check the configs of `directory` (torch-free); CheckpointError names a misfit."""

    @abstractmethod
    def load(
        self, spec: CheckpointSpec, dtype: torch.dtype, device: torch.device, vae_dtype: torch.dtype
    ) -> FamilyModel:
        """Load and validate every component of `spec`'s checkpoint onto `device`, the VAE in `vae_dtype`."""

    @abstractmethod
    def meta_transformer(self, spec: CheckpointSpec) -> nn.Module:
        """The checkpoint's transformer built on the meta device from its config (shapes, no weights)."""

    @abstractmethod
    def spec_for(self, model: FamilyModel, name: str, defaults: GenerationDefaults) -> CheckpointSpec:
        """The spec of a model built in memory (training, benchmarks), as `inspect` gives it on disk."""

    @abstractmethod
    def convert_lora(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """diffusers' key conversion of a LoRA file for this family (to `transformer.<module>.lora_A/B`)."""

    def memory_profile(self, spec: CheckpointSpec, dtype_bytes: int, vae_dtype_bytes: int) -> Any:
        """Torch-free: a `qwen_image_fusion.models.memory.MemoryProfile` (which imports this module, hence
        `Any`) of its components' device bytes (from the safetensors headers, loaded at `dtype_bytes` per
        element, the VAE at `vae_dtype_bytes`) and activations, for the GPU-memory planner; None: this family
        plans no memory (everything is loaded onto the device)."""
        return None


def parameter_summary(module: nn.Module) -> str:
    """'12.34M parameters (bfloat16 12.00M, float8_e4m3fn 0.34M)' for `info`; packed NVFP4 weights (uint8,
    two E2M1 values a byte) count as the values they hold."""
    by_dtype: dict[str, int] = {}
    for p in module.parameters():
        name = str(p.dtype).removeprefix("torch.")
        count = p.numel()
        if name == "uint8":
            name, count = "e2m1", 2 * count
        by_dtype[name] = by_dtype.get(name, 0) + count
    dtypes = ", ".join(f"{name} {n / 1e6:.2f}M" for name, n in sorted(by_dtype.items(), key=lambda i: -i[1]))
    return f"{sum(by_dtype.values()) / 1e6:,.2f}M parameters ({dtypes})"
