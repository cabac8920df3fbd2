"""ModelOpt FP8 checkpoints: the quantization config, validation of per-layer scales, linear swapping."""

import fnmatch
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.quant import FP8_DTYPE
from models.errors import CheckpointError
from models.fp8 import Fp8Linear

SCALE_SUFFIXES = (".weight_scale", ".input_scale")


@dataclass(frozen=True)
class QuantConfig:
    """The parts of a ModelOpt config we act on: algorithm and the modules left unquantized."""

    quant_algo: str
    ignore: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    def ignores(self, module_name: str) -> bool:
        return any(fnmatch.fnmatchcase(module_name, pattern) for pattern in self.ignore)


def parse_quant_config(config: dict[str, Any], hf_quant_config: dict[str, Any] | None) -> QuantConfig | None:
    """Read `quantization_config` (flat) or `hf_quant_config.json` (nested); None when neither exists."""
    flat = config.get("quantization_config")
    if flat is not None:
        method = str(flat.get("quant_method", "")).lower()
        if method != "modelopt":
            raise CheckpointError(
                f"unsupported quantization method {method!r}: only ModelOpt FP8 is supported"
            )
        algo, ignore, raw = flat.get("quant_algo"), flat.get("ignore", []), flat
    elif hf_quant_config is not None:
        nested = hf_quant_config.get("quantization", {})
        algo, ignore, raw = nested.get("quant_algo"), nested.get("exclude_modules", []), hf_quant_config
    else:
        return None
    if str(algo).upper() != "FP8":
        raise CheckpointError(
            f"unsupported ModelOpt quant_algo {algo!r}: only FP8 (per-tensor static) is supported"
        )
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise CheckpointError("ModelOpt ignore/exclude_modules must be a list of glob strings")
    return QuantConfig("FP8", tuple(ignore), raw)


def fp8_module_names(state: dict[str, torch.Tensor]) -> list[str]:
    """Modules whose stored weight is FP8 (or that carry ModelOpt scales)."""
    names = {
        k.removesuffix(".weight") for k, v in state.items() if k.endswith(".weight") and v.dtype == FP8_DTYPE
    }
    names |= {k.rsplit(".", 1)[0] for k in state if k.endswith(SCALE_SUFFIXES)}
    return sorted(names)


def check_fp8_tensors(name: str, state: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse a broken FP8 layer: missing scale, wrong dtype, non-scalar, non-finite or non-positive scale."""
    weight = state.get(f"{name}.weight")
    if weight is None:
        raise CheckpointError(f"{where}: {name}.weight is missing")
    if weight.dtype != FP8_DTYPE:
        raise CheckpointError(f"{where}: {name}.weight is {weight.dtype}, expected float8_e4m3fn")
    for suffix in SCALE_SUFFIXES:
        key = name + suffix
        scale = state.get(key)
        if scale is None:
            raise CheckpointError(f"{where}: {key} is missing")
        if not scale.is_floating_point() or scale.dtype == FP8_DTYPE:
            raise CheckpointError(f"{where}: {key} has dtype {scale.dtype}, expected a float scale")
        if scale.numel() != 1 or scale.dim() > 1:
            raise CheckpointError(f"{where}: {key} has shape {list(scale.shape)}, expected [] or [1]")
        value = float(scale.float().item())
        if not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{where}: {key} is {value}, expected a finite scale > 0")
    bias = state.get(f"{name}.bias")
    if bias is not None and bias.dtype == FP8_DTYPE:
        raise CheckpointError(f"{where}: {name}.bias is FP8, expected BF16")


def swap_fp8_linears(
    model: nn.Module, state: dict[str, torch.Tensor], quant: QuantConfig | None, where: Path
) -> list[str]:
    """Replace the Linears stored as FP8 by `Fp8Linear` (call on a meta-device model); returns their names."""
    names = fp8_module_names(state)
    if names and quant is None:
        raise CheckpointError(f"{where}: FP8 tensors (e.g. {names[0]}) but no ModelOpt quantization_config")
    modules = dict(model.named_modules())
    for name in names:
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise CheckpointError(f"{where}: {name} carries FP8 tensors but is not a Linear of this model")
        if quant.ignores(name):
            raise CheckpointError(f"{where}: {name} matches an ignore pattern but is stored as FP8")
        check_fp8_tensors(name, state, where)
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        fp8 = Fp8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        parent.register_module(child, fp8)
        for suffix in SCALE_SUFFIXES:
            state[name + suffix] = state[name + suffix].reshape(())
    return names
