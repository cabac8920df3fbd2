"""Reading and writing diffusers-layout component directories (config.json + safetensors shards), for
every model family: weights checked by name and shape, ModelOpt FP8 and NVFP4 layers swapped in, library
noise silenced so a load error is one line."""

import json
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils import logging as diffusers_logging
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.utils import logging as transformers_logging

from qwen_image_fusion.models.checkpoint import (
    MODELOPT_SCALE_SUFFIXES,
    read_hf_quant_config,
    read_json,
    weight_files,
)
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.modelopt import QuantConfig, parse_quant_config, swap_quantized_linears

STORED_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # quantized weights (FP8, packed NVFP4): kept as stored

WEIGHTS_STEM = "diffusion_pytorch_model"
SHARD_BYTES = 5 * 1024**3


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
        if not found[name].is_floating_point() and not (tensor.dtype == torch.uint8 == found[name].dtype):
            raise CheckpointError(f"{source}: tensor {name} has non-float dtype {found[name].dtype}")
        if found[name].dtype == torch.float8_e4m3fn and tensor.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{source}: tensor {name} is FP8 but its layer is not quantized")


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Model dtype for ordinary weights; quantized weights and ModelOpt scales stay as stored."""
    if tensor.dtype in STORED_DTYPES or name.endswith(MODELOPT_SCALE_SUFFIXES):
        return tensor
    return tensor.to(dtype)


def load_transformer(
    directory: Path,
    build: Callable[[dict[str, Any]], nn.Module],
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """The transformer of `directory` (BF16, ModelOpt FP8 or NVFP4) on `device` without a random init: `build`
    makes the model from its config.json (refusing a bad config in one line)."""
    raw = read_json(directory / "config.json")
    quant = parse_quant_config(raw, read_hf_quant_config(directory))
    with torch.device("meta"):
        model = build(raw)
    origins: dict[str, Path] = {}
    state = read_state_dict(directory, device, origins)
    return transformer_from_state(model, state, quant, dtype, directory, origins)


def meta_transformer(directory: Path, build: Callable[[dict[str, Any]], nn.Module]) -> nn.Module:
    """The transformer of `directory` built from its config.json on the meta device (shapes, no weights)."""
    with torch.device("meta"):
        return build(read_json(directory / "config.json"))


def transformer_from_state(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    quant: QuantConfig | None,
    dtype: torch.dtype,
    where: Path,
    origins: dict[str, Path] | None = None,
) -> nn.Module:
    """`model` (built on the meta device) holding `state`, validated first, quantized layers swapped in,
    then its `post_load_weights` run."""
    swap_quantized_linears(model, state, quant, where)
    check_state_dict(model.state_dict(), state, where, origins)
    model.load_state_dict({k: _cast(k, v, dtype) for k, v in state.items()}, strict=True, assign=True)
    model.eval().requires_grad_(False)
    model.quant_config = quant
    model.post_load_weights()
    return model


def save_transformer(model: nn.Module, directory: Path, shard_bytes: int = SHARD_BYTES) -> None:
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


@contextmanager
def quiet_loading() -> Iterator[None]:
    """Silence library progress bars, info logs and warnings while loading, so that a load error is the
    one line the user sees (our own checks report every real problem)."""
    bars = transformers_logging.is_progress_bar_enabled()
    levels = transformers_logging.get_verbosity(), diffusers_logging.get_verbosity()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers_logging.set_verbosity(levels[0])
        diffusers_logging.set_verbosity(levels[1])
        if bars:
            transformers_logging.enable_progress_bar()


def load_diffusers_model(
    directory: Path, model_class: type, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """A diffusers model (a VAE) of a local folder, built from its config.json on the meta device and given
    its safetensors, every tensor checked by name and shape; a config the class refuses is one line."""
    config_path = directory / "config.json"
    config = read_json(config_path)
    try:
        with torch.device("meta"):
            model = model_class.from_config(config)
    except (TypeError, ValueError, IndexError, RuntimeError) as err:
        raise CheckpointError(f"{config_path}: not a valid {model_class.__name__} config: {err}") from err
    origins: dict[str, Path] = {}
    state = read_state_dict(directory, device, origins)
    check_state_dict(model.state_dict(), state, directory, origins)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def load_pretrained_model(
    directory: Path, model_class: type, dtype: torch.dtype, device: torch.device | str, what: str
) -> nn.Module:
    """A transformers model (`what`: e.g. "text encoder") of a local folder, every weight required and
    shaped as its config.json says; any loading problem is one CheckpointError."""
    if not directory.is_dir():
        raise CheckpointError(f"{what} folder not found: {directory}")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{what} folder has no config.json: {directory}")
    try:
        model, info = model_class.from_pretrained(
            directory,
            local_files_only=True,
            dtype=dtype,
            ignore_mismatched_sizes=True,  # reported below as one message instead of a log table
            output_loading_info=True,
        )
    except Exception as exc:  # transformers raises OSError, ValueError, RuntimeError... for a bad folder
        raise CheckpointError(f"{what} in {directory} cannot be loaded: {exc}".splitlines()[0]) from exc
    mismatched = sorted(
        f"{key} is {tuple(saved)}, config wants {tuple(wanted)}"
        for key, saved, wanted in info["mismatched_keys"]
    )
    if mismatched:
        raise CheckpointError(
            f"{what} in {directory} does not match its config.json ({len(mismatched)} tensors, "
            f"e.g. {mismatched[0]})"
        )
    missing = sorted(info["missing_keys"])
    if missing:
        raise CheckpointError(
            f"{what} in {directory} lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}"
        )
    return model.to(device).eval()


def load_scheduler(directory: Path) -> FlowMatchEulerDiscreteScheduler:
    """The scheduler of `scheduler/scheduler_config.json`."""
    read_json(directory / "scheduler_config.json")
    try:
        return FlowMatchEulerDiscreteScheduler.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"cannot load scheduler from {directory}: {err}") from err
