"""Reading and writing diffusers-layout transformer directories (config.json + safetensors shards)."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.config import QwenImageConfig
from models.errors import CheckpointError
from models.modelopt import (
    SCALE_SUFFIXES,
    QuantConfig,
    parse_quant_config,
    swap_fp8_linears,
)
from models.transformer import QwenImageTransformer

WEIGHTS_STEM = "diffusion_pytorch_model"
SHARD_BYTES = 5 * 1024**3


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file, refusing a missing or malformed one with a message naming it."""
    if not path.is_file():
        raise CheckpointError(f"missing {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err


def read_hf_quant_config(directory: Path) -> dict[str, Any] | None:
    """The nested ModelOpt `hf_quant_config.json` of a transformer directory (or its parent), if any."""
    for path in (directory / "hf_quant_config.json", directory.parent / "hf_quant_config.json"):
        if path.is_file():
            return read_json(path)
    return None


def weight_files(directory: Path) -> list[Path]:
    """Safetensors files of a component directory: the shards of its index, or its single file."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = read_json(indexes[0]).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{indexes[0]} has no weight_map")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{directory}: shards listed in {indexes[0].name} are missing: {missing[:3]}"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {directory}")
    return files


def read_state_dict(
    directory: Path, device: torch.device | str = "cpu", origins: dict[str, Path] | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of a component directory, loaded straight onto `device`; `origins` (when given)
    receives the file each tensor came from, for error messages."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            shard = load_file(path, device=str(device))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"cannot read {path}: {err}") from err
        duplicated = state.keys() & shard.keys()
        if duplicated:
            raise CheckpointError(f"{path.name} repeats tensors of another shard: {sorted(duplicated)[:3]}")
        state.update(shard)
        if origins is not None:
            origins.update(dict.fromkeys(shard, path))
    return state


def check_state_dict(
    expected: dict[str, torch.Tensor],
    found: dict[str, torch.Tensor],
    where: Path,
    origins: dict[str, Path] | None = None,
) -> None:
    """Refuse missing, unexpected or wrongly shaped tensors, naming the first offenders (and the file
    holding a misfit tensor, when `origins` says)."""
    origins = origins or {}
    missing = sorted(expected.keys() - found.keys())
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} tensors missing, e.g. {missing[:3]}")
    unexpected = sorted(found.keys() - expected.keys())
    if unexpected:
        raise CheckpointError(f"{where}: {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}")
    for name, tensor in expected.items():
        source = origins.get(name, where)
        if found[name].shape != tensor.shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {list(found[name].shape)}, expected {list(tensor.shape)}"
            )
        if not found[name].is_floating_point():
            raise CheckpointError(f"{source}: tensor {name} has non-float dtype {found[name].dtype}")
        if found[name].dtype == torch.float8_e4m3fn and tensor.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{source}: tensor {name} is FP8 but its layer is not quantized")


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Model dtype for ordinary weights; FP8 weights and ModelOpt scales stay as stored."""
    if tensor.dtype == torch.float8_e4m3fn or name.endswith(SCALE_SUFFIXES):
        return tensor
    return tensor.to(dtype)


def load_transformer(directory: Path, dtype: torch.dtype, device: torch.device) -> QwenImageTransformer:
    """Build the transformer of `directory` (BF16 or ModelOpt FP8) on `device` without a random init."""
    raw = read_json(directory / "config.json")
    config = QwenImageConfig.from_dict(raw)
    quant = parse_quant_config(raw, read_hf_quant_config(directory))
    origins: dict[str, Path] = {}
    state = read_state_dict(directory, device, origins)
    return transformer_from_state(config, state, quant, dtype, directory, origins)


def transformer_from_state(
    config: QwenImageConfig,
    state: dict[str, torch.Tensor],
    quant: QuantConfig | None,
    dtype: torch.dtype,
    where: Path,
    origins: dict[str, Path] | None = None,
    model_class: Callable[[Any], torch.nn.Module] = QwenImageTransformer,
) -> QwenImageTransformer:
    """A transformer holding `state` (validated first; FP8 layers swapped in), after `post_load_weights`;
    `model_class(config)` builds it (another model family passes its own)."""
    with torch.device("meta"):
        model = model_class(config)
        swap_fp8_linears(model, state, quant, where)
    check_state_dict(model.state_dict(), state, where, origins)
    model.load_state_dict({k: _cast(k, v, dtype) for k, v in state.items()}, strict=True, assign=True)
    model.eval().requires_grad_(False)
    model.quant_config = quant
    model.post_load_weights()
    return model


def save_transformer(model: QwenImageTransformer, directory: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Write config.json and safetensors (sharded with an index past `shard_bytes`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    save_tensors({k: v.contiguous() for k, v in model.state_dict().items()}, directory, shard_bytes)


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Write tensors as one safetensors file, or as shards plus a `.index.json` weight map."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / f"{WEIGHTS_STEM}.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"{WEIGHTS_STEM}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / filename)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    index["weight_map"] = weight_map
    (directory / f"{WEIGHTS_STEM}.safetensors.index.json").write_text(json.dumps(index, indent=2))
