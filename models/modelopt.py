"""ModelOpt FP8 checkpoints: the quantization config, validation of per-layer scales, linear swapping."""

import fnmatch
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qwen_image_fusion.kernels.quant import FP8_DTYPE
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.fp8 import Fp8Linear
from qwen_image_fusion.models.fp8_weight_only import WEIGHT_ONLY_KEY, Fp8WeightOnlyLinear

SCALE_SUFFIXES = (".weight_scale", ".input_scale")


@dataclass(frozen=True)
class QuantConfig:
    """The parts of a ModelOpt config we act on: algorithm and the modules left unquantized."""

    quant_algo: str
    ignore: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False)
    weight_only: tuple[str, ...] = ()  # globs of FP8 weight-only linears (models/fp8_weight_only.py)

    def ignores(self, module_name: str) -> bool:
        return any(fnmatch.fnmatchcase(module_name, pattern) for pattern in self.ignore)

    def weight_only_layer(self, module_name: str) -> bool:
        return any(fnmatch.fnmatchcase(module_name, pattern) for pattern in self.weight_only)


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
        weight_only = flat.get(WEIGHT_ONLY_KEY, [])
    elif hf_quant_config is not None:
        nested = hf_quant_config.get("quantization", {})
        algo, ignore, raw = nested.get("quant_algo"), nested.get("exclude_modules", []), hf_quant_config
        weight_only = nested.get(WEIGHT_ONLY_KEY, [])
    else:
        return None
    if str(algo).upper() != "FP8":
        raise CheckpointError(
            f"unsupported ModelOpt quant_algo {algo!r}: only FP8 (per-tensor static) is supported"
        )
    for key, globs in (("ignore/exclude_modules", ignore), (WEIGHT_ONLY_KEY, weight_only)):
        if not isinstance(globs, list) or not all(isinstance(p, str) for p in globs):
            raise CheckpointError(f"ModelOpt {key} must be a list of glob strings")
    return QuantConfig("FP8", tuple(ignore), raw, tuple(weight_only))


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
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        shape = (linear.in_features, linear.out_features)
        if quant.weight_only_layer(name):
            check_weight_only_tensors(name, state, linear.out_features, where)
            parent.register_module(child, Fp8WeightOnlyLinear(*shape, bias=linear.bias is not None))
            continue
        check_fp8_tensors(name, state, where)
        parent.register_module(child, Fp8Linear(*shape, bias=linear.bias is not None))
        for suffix in SCALE_SUFFIXES:
            state[name + suffix] = state[name + suffix].reshape(())
    return names


def check_weight_only_tensors(name: str, state: dict[str, torch.Tensor], out: int, where: Path) -> None:
    """A weight-only FP8 layer: an E4M3 weight, an fp32 scale per output channel, finite and > 0, and no
    input scale (its input stays BF16)."""
    weight, scale = state.get(f"{name}.weight"), state.get(f"{name}.weight_scale")
    if weight is None or weight.dtype != FP8_DTYPE:
        raise CheckpointError(f"{where}: {name}.weight must be float8_e4m3fn for a weight-only FP8 layer")
    if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (out,):
        raise CheckpointError(f"{where}: {name}.weight_scale must be float32 [{out}], one per output channel")
    if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
        raise CheckpointError(f"{where}: {name}.weight_scale has values that are not finite and > 0")
    if f"{name}.input_scale" in state:
        raise CheckpointError(f"{where}: {name} is weight-only FP8 but has an input_scale")
