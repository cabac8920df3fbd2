"""ModelOpt checkpoints (FP8 and NVFP4): the quantization config, validation of per-layer scales, linear
swapping."""

import fnmatch
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qwen_image_fusion.kernels.nvfp4 import NVFP4_BLOCK
from qwen_image_fusion.kernels.quant import FP8_DTYPE
from qwen_image_fusion.models.checkpoint import (
    MODELOPT_SCALE_SUFFIXES,
    WeightFormat,
    modelopt_format,
    modelopt_section,
)
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.fp8 import Fp8Linear
from qwen_image_fusion.models.fp8_weight_only import WEIGHT_ONLY_KEY, Fp8WeightOnlyLinear
from qwen_image_fusion.models.nvfp4 import Nvfp4Linear

SCALE_SUFFIXES = (".weight_scale", ".input_scale")
GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class ModuleRules:
    """Module-name rules as ModelOpt's exclusion lists write them: a glob (`*`, `?`, `[`) matches a name as
    `fnmatch` does; a literal name matches that module and every module inside it. Literals are a set,
    looked up for the name and each of its dotted ancestors, so an export listing hundreds of literal names
    costs a few lookups per module, not one match per rule."""

    literal: frozenset[str]
    globs: tuple[str, ...]

    @classmethod
    def of(cls, rules: tuple[str, ...]) -> "ModuleRules":
        globs = tuple(r for r in rules if GLOB_CHARS & set(r))
        return cls(frozenset(rules) - frozenset(globs), globs)

    def match(self, name: str) -> bool:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.globs):
            return True
        while name:
            if name in self.literal:
                return True
            name = name.rpartition(".")[0]
        return False


@dataclass(frozen=True)
class QuantConfig:
    """The parts of a ModelOpt config we act on: algorithm, the modules left unquantized, NVFP4's group
    size."""

    quant_algo: str  # "FP8" or "NVFP4"
    ignore: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False)
    weight_only: tuple[str, ...] = ()  # globs of FP8 weight-only linears (models/fp8_weight_only.py)
    group_size: int | None = None  # NVFP4: values sharing one block scale (16)

    @cached_property
    def _ignored(self) -> ModuleRules:
        return ModuleRules.of(self.ignore)

    @cached_property
    def _weight_only(self) -> ModuleRules:
        return ModuleRules.of(self.weight_only)

    @property
    def weights(self) -> WeightFormat:
        return modelopt_format(self.quant_algo)

    def ignores(self, module_name: str) -> bool:
        return self._ignored.match(module_name)

    def weight_only_layer(self, module_name: str) -> bool:
        return self._weight_only.match(module_name)


def parse_quant_config(config: dict[str, Any], hf_quant_config: dict[str, Any] | None) -> QuantConfig | None:
    """Read `quantization_config` (flat) or `hf_quant_config.json` (nested); None when neither exists."""
    section = modelopt_section(config, hf_quant_config)
    if section is None:
        return None
    flat = "quantization_config" in config
    algo = modelopt_format(section.get("quant_algo"))
    ignore = section.get("ignore" if flat else "exclude_modules", [])
    weight_only = section.get(WEIGHT_ONLY_KEY, [])
    for key, globs in (("ignore/exclude_modules", ignore), (WEIGHT_ONLY_KEY, weight_only)):
        if not isinstance(globs, list) or not all(isinstance(p, str) for p in globs):
            raise CheckpointError(f"ModelOpt {key} must be a list of module names or glob strings")
    raw = section if flat else hf_quant_config
    if algo is WeightFormat.FP8:
        return QuantConfig("FP8", tuple(ignore), raw, tuple(weight_only))
    if weight_only:
        raise CheckpointError(f"ModelOpt NVFP4: {WEIGHT_ONLY_KEY} is for FP8 checkpoints only")
    return QuantConfig("NVFP4", tuple(ignore), raw, group_size=nvfp4_group_size(section))


def nvfp4_group_size(section: dict[str, Any]) -> int:
    """The NVFP4 block size a quantization section declares (`group_size`, or its config groups' weights'),
    which must be 16."""
    groups = section.get("config_groups") or {}
    found = {section.get("group_size")} | {
        g.get("weights", {}).get("group_size") for g in groups.values() if isinstance(g, dict)
    }
    found.discard(None)
    if found != {NVFP4_BLOCK}:
        raise CheckpointError(
            f"ModelOpt NVFP4 group_size {sorted(found, key=str) or 'missing'}: "
            f"only {NVFP4_BLOCK} is supported"
        )
    return NVFP4_BLOCK


def quantized_module_names(state: dict[str, torch.Tensor]) -> list[str]:
    """Modules whose stored weight is FP8 or packed NVFP4 (uint8), or that carry ModelOpt scales."""
    names = {
        k.removesuffix(".weight")
        for k, v in state.items()
        if k.endswith(".weight") and v.dtype in (FP8_DTYPE, torch.uint8)
    }
    names |= {k.rsplit(".", 1)[0] for k in state if k.endswith(MODELOPT_SCALE_SUFFIXES)}
    return sorted(names)


def check_scalar_scale(key: str, state: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse a missing per-tensor scale, or one that is not a float scalar ([] or [1]), finite and > 0."""
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


def check_fp8_tensors(name: str, state: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse a broken FP8 layer: missing scale, wrong dtype, non-scalar, non-finite or non-positive scale."""
    weight = state.get(f"{name}.weight")
    if weight is None:
        raise CheckpointError(f"{where}: {name}.weight is missing")
    if weight.dtype != FP8_DTYPE:
        raise CheckpointError(f"{where}: {name}.weight is {weight.dtype}, expected float8_e4m3fn")
    for suffix in SCALE_SUFFIXES:
        check_scalar_scale(name + suffix, state, where)
    check_bias(name, state, where)


def check_nvfp4_tensors(name: str, linear: nn.Linear, state: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse a broken NVFP4 layer by the tensor's name: a packed uint8 weight [out, in/2], E4M3 block
    scales [out, in/16] neither NaN nor negative, float scalars `weight_scale_2` and `input_scale`."""
    out, k = linear.out_features, linear.in_features
    if k % NVFP4_BLOCK:
        raise CheckpointError(f"{where}: {name} has {k} inputs, not a multiple of {NVFP4_BLOCK} (NVFP4)")
    for suffix, dtype, shape in (
        (".weight", torch.uint8, (out, k // 2)),
        (".weight_scale", FP8_DTYPE, (out, k // NVFP4_BLOCK)),
    ):
        tensor = state.get(name + suffix)
        if tensor is None:
            raise CheckpointError(f"{where}: {name}{suffix} is missing")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{where}: {name}{suffix} is {str(tensor.dtype).removeprefix('torch.')} "
                f"{list(tensor.shape)}, expected {str(dtype).removeprefix('torch.')} {list(shape)} (NVFP4)"
            )
    bits = state[f"{name}.weight_scale"].view(torch.uint8)
    if bool(((bits & 0x7F) == 0x7F).any() or (bits > 0x80).any()):
        raise CheckpointError(f"{where}: {name}.weight_scale has NaN or negative block scales")
    for suffix in (".weight_scale_2", ".input_scale"):
        check_scalar_scale(name + suffix, state, where)
    check_bias(name, state, where)


def check_bias(name: str, state: dict[str, torch.Tensor], where: Path) -> None:
    bias = state.get(f"{name}.bias")
    if bias is not None and (bias.dtype == FP8_DTYPE or not bias.is_floating_point()):
        raise CheckpointError(f"{where}: {name}.bias is {bias.dtype}, expected BF16")


def swap_quantized_linears(
    model: nn.Module, state: dict[str, torch.Tensor], quant: QuantConfig | None, where: Path
) -> list[str]:
    """Replace the Linears stored quantized by `Fp8Linear`, `Fp8WeightOnlyLinear` or `Nvfp4Linear` (call on a
    meta-device model), each layer's tensors checked first; returns their names."""
    names = quantized_module_names(state)
    if names and quant is None:
        raise CheckpointError(
            f"{where}: quantized tensors (e.g. {names[0]}) but no ModelOpt quantization_config"
        )
    modules = dict(model.named_modules())
    nvfp4 = quant is not None and quant.weights is WeightFormat.NVFP4
    for name in names:
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise CheckpointError(
                f"{where}: {name} carries quantized tensors but is not a Linear of this model"
            )
        if quant.ignores(name):
            raise CheckpointError(
                f"{where}: {name} matches an ignore pattern but is stored as {quant.weights.name}"
            )
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        shape = (linear.in_features, linear.out_features)
        if nvfp4:
            check_nvfp4_tensors(name, linear, state, where)
            parent.register_module(child, Nvfp4Linear(*shape, bias=linear.bias is not None))
            scalars = (".weight_scale_2", ".input_scale")
        elif quant.weight_only_layer(name):
            check_weight_only_tensors(name, state, linear.out_features, where)
            parent.register_module(child, Fp8WeightOnlyLinear(*shape, bias=linear.bias is not None))
            continue
        else:
            check_fp8_tensors(name, state, where)
            parent.register_module(child, Fp8Linear(*shape, bias=linear.bias is not None))
            scalars = SCALE_SUFFIXES
        for suffix in scalars:
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


def weight_format(model: nn.Module) -> WeightFormat:
    """How a loaded model's linears are stored: NVFP4 or FP8 where any is, else BF16."""
    kinds = {type(m) for m in model.modules()}
    if Nvfp4Linear in kinds:
        return WeightFormat.NVFP4
    return WeightFormat.FP8 if kinds & {Fp8Linear, Fp8WeightOnlyLinear} else WeightFormat.BF16
