"""LoRA files: read in every layout diffusers' Qwen-Image loaders read, converted to our module names.

diffusers' own conversion (the family's `convert_lora`, e.g. `QwenImageLoraLoaderMixin.lora_state_dict`)
maps kohya (`lora_unet_...`), ComfyUI (`diffusion_model.`), `lora_down`/`lora_up`/`alpha` and the
Lightning release layouts to `transformer.<module>.lora_A/lora_B`; PEFT's LoraConfig in the header (rank
and alpha patterns) gives each module its alpha. Files are validated completely before anything is
mounted: a bad file changes nothing (models/lora.py mounts them).
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from qwen_image_fusion.models.errors import CheckpointError, InputError

DOWN, UP = ".lora_A.weight", ".lora_B.weight"
TRANSFORMER_PREFIX = "transformer."
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # diffusers' safetensors header key for the LoraConfig
# diffusers' key conversion: a raw state dict in, `transformer.<module>.lora_A/B.weight` keys out
LoraConverter = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LoraFactors:
    """One adapter of one linear: down A [r, in], up B [out, r], and PEFT's alpha (and rsLoRA flag)."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float
    use_rslora: bool = False

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def scaling(self, scale: float) -> float:
        """PEFT's `set_scale`: `scale * lora_alpha / r` (`/ sqrt(r)` with rsLoRA), in that order."""
        return scale * self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class LoraFile:
    """A LoRA file read and converted to diffusers' names: factors by transformer module name."""

    path: Path
    factors: dict[str, LoraFactors]


def read_lora_file(path: str | Path, convert: LoraConverter) -> LoraFile:
    """Read a LoRA safetensors file in any layout diffusers' Qwen-Image loader reads (diffusers/PEFT
    `lora_A`/`lora_B`, kohya `lora_unet_...`, ComfyUI `diffusion_model.`, `lora_down`/`lora_up`/`alpha`,
    the Lightning release files); CheckpointError naming the file and key for anything else."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"LoRA file {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        raw = load_file(path)
        with safe_open(path, framework="pt") as handle:
            header = handle.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"LoRA file {path} is not a safetensors file ({err})") from err
    if not raw:
        raise CheckpointError(f"LoRA file {path} holds no tensors")
    for key, tensor in raw.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"LoRA file {path}: tensor {key} has NaN or inf values")
    pairs = _pair_factors(_to_diffusers_keys(raw, path, convert), path)
    return LoraFile(path, _with_alphas(pairs, _adapter_metadata(header, path), path))


def _to_diffusers_keys(
    raw: dict[str, torch.Tensor], path: Path, convert: LoraConverter
) -> dict[str, torch.Tensor]:
    """diffusers' own conversion (it folds kohya alphas into the factors, as diffusers loads them), then
    the names of our transformer's modules (without the `transformer.` prefix)."""
    from qwen_image_fusion.models.loading import quiet_loading

    try:
        with quiet_loading():
            state = convert(dict(raw))
    except (ValueError, KeyError, IndexError, RuntimeError) as err:
        message = str(err).splitlines()[0][:300]
        raise CheckpointError(f"LoRA file {path}: diffusers' LoRA conversion refuses it: {message}") from err
    return {key.removeprefix(TRANSFORMER_PREFIX): value for key, value in state.items()}


def _pair_factors(state: dict[str, torch.Tensor], path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A, B)} from `<module>.lora_A.weight` / `.lora_B.weight` keys, each pair checked."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if key.endswith((DOWN, UP)):
            module, suffix = key[: -len(DOWN)], DOWN if key.endswith(DOWN) else UP
            parts.setdefault(module, {})[suffix] = tensor
            continue
        what = "not a lora_A/lora_B factor"
        if "lora_magnitude_vector" in key or ".bias" in key:
            what = "DoRA magnitudes and LoRA biases are not supported"
        raise CheckpointError(f"LoRA file {path}: tensor {key} is not supported ({what})")
    pairs = {}
    for module, found in parts.items():
        for suffix in (DOWN, UP):
            if suffix not in found:
                raise CheckpointError(f"LoRA file {path}: {module}{suffix} is missing (its pair is there)")
        down, up = found[DOWN], found[UP]
        if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
            raise CheckpointError(
                f"LoRA file {path}: {module}{DOWN} {list(down.shape)} and {module}{UP} {list(up.shape)} "
                "are not a rank-r pair [r, in] and [out, r]"
            )
        pairs[module] = (down, up)
    return pairs


def _adapter_metadata(header: dict[str, str], path: Path) -> dict[str, Any] | None:
    """The LoraConfig diffusers stores in the safetensors header (its `transformer.` entries), if any."""
    raw = header.get(LORA_ADAPTER_METADATA_KEY)
    if not raw:
        return None
    try:
        metadata = json.loads(raw)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"LoRA file {path}: {LORA_ADAPTER_METADATA_KEY} is not valid JSON") from err
    prefix = TRANSFORMER_PREFIX
    config = {k.removeprefix(prefix): v for k, v in metadata.items() if k.startswith(prefix)}
    return config or None


def _with_alphas(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], metadata: dict[str, Any] | None, path: Path
) -> dict[str, LoraFactors]:
    """Each pair with PEFT's alpha for its module, as diffusers configures the adapter.

    Without metadata diffusers sets alpha = r for every module (scale 1: kohya alphas are already folded
    into the factors). With metadata, PEFT's LoraConfig and its rank/alpha patterns decide.
    """
    if metadata is None:
        return {module: LoraFactors(down, up, down.shape[0]) for module, (down, up) in pairs.items()}
    try:
        from peft import LoraConfig
        from peft.utils.other import get_pattern_key
    except ImportError as err:
        raise CheckpointError(
            f"LoRA file {path} carries diffusers' LoraConfig metadata: reading it needs `pip install peft`"
        ) from err
    try:
        config = LoraConfig(**metadata)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"LoRA file {path}: its adapter metadata is not a LoraConfig: {err}") from err
    if config.use_dora or config.lora_bias:
        raise CheckpointError(f"LoRA file {path}: DoRA and LoRA bias adapters are not supported")
    factors = {}
    for module, (down, up) in pairs.items():
        ranks, alphas = config.rank_pattern, config.alpha_pattern
        rank = ranks.get(get_pattern_key(ranks.keys(), module), config.r)
        alpha = alphas.get(get_pattern_key(alphas.keys(), module), config.lora_alpha)
        if rank != down.shape[0]:
            raise CheckpointError(
                f"LoRA file {path}: its metadata gives {module} rank {rank}, but {module}{DOWN} has rank "
                f"{down.shape[0]}"
            )
        factors[module] = LoraFactors(down, up, alpha, bool(config.use_rslora))
    return factors
