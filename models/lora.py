"""LoRA adapters by module swap (PEFT's `base_layer`), for BF16 and ModelOpt FP8 linears.

`LoraLinear` takes the place of a Linear or an `Fp8Linear` in the transformer and holds named adapters:
down factor A [r, in], up factor B [out, r], PEFT's `lora_alpha` and a user scale. It runs one of three ways:

- reference branch: `result = base(x)`, then per adapter `result = result + B(A(x)) * scaling`, op for op
  as PEFT's `lora.Linear.forward` (with `scaling = scale * alpha / r`, PEFT's `set_scale`), so the
  `reference` variant is pixel-identical to diffusers + PEFT;
- contract branch: every adapter with a non-zero scale in one pair of GEMMs (the factors concatenated,
  each scaling folded into its up factor), the second accumulating into the base output;
- merged: the adapters folded into the base weight (BF16: one fp32 sum, rounded once; FP8: dequantize,
  add, requantize with a new per-tensor weight scale, the calibrated input scale kept). The original
  weight waits on the host, so unmerging restores it bit for bit.

Around an FP8 consumer the branch reads the BF16 input: `quant_spec()` delegates to the base layer and
declares that it needs the unquantized input, so the fusion gate keeps the producer fused with dual
output (`q` for the FP8 GEMM, `y` for the branch). Unfused, the base quantizes `x` itself and the branch
reads the same `x`: fused and unfused stay byte-identical.

Files are read and validated by models/lora_files.py and only then mounted: a bad file changes nothing. Each
adapter's user scale lives once, in the mapping the owner (qwen_image_fusion.pipelines.lora.LoraSet) shares
with every wrapper; after changing a scale the owner calls `refresh()` on the wrappers holding that adapter.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from qwen_image_fusion.kernels.numerics import Numerics
from qwen_image_fusion.kernels.quant import FP8_MAX
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.fp8 import (
    Fp8Linear,
    QuantizedActivation,
    QuantSpec,
    quant_consumer_spec,
    quantize_weight,
)
from qwen_image_fusion.models.fp8_weight_only import Fp8WeightOnlyLinear, quantize_per_channel
from qwen_image_fusion.models.lora_files import DOWN, LoraFactors, LoraFile
from qwen_image_fusion.models.numerics import NumericsAware
from qwen_image_fusion.models.nvfp4 import Nvfp4Linear


@dataclass(frozen=True)
class Fp8MergeStats:
    """What requantizing one FP8 weight with a LoRA folded in did."""

    weights: int
    clipped: int  # |w / new_scale| beyond 448 before the clamp
    max_abs_error: float  # max |dequantized new weight - (old weight + delta)|
    scale_ratio: float  # new weight_scale / old weight_scale


class LoraLinear(NumericsAware, nn.Module):
    """A Linear or `Fp8Linear` (`base_layer`) with named LoRA adapters applied beside it or merged into it;
    `scales` (the user scale of each adapter by name) is the owner's mapping, not a copy."""

    def __init__(
        self, base_layer: nn.Module, scales: Mapping[str, float], device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.device = base_layer.weight.device if device is None else device  # where its LoRA math runs
        self.adapters: dict[str, LoraFactors] = {}  # on the base's device, in the activation dtype
        self.scales = scales
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # contract branch factors
        self._merged: tuple[tuple[str, float], ...] | None = None  # the scalings folded into the weight
        self._original: tuple[torch.Tensor, ...] = ()  # host copy of the weight (and FP8 scale)
        self.merge_stats: Fp8MergeStats | None = None

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def reads_row_slices(self) -> bool:
        return getattr(self.base_layer, "reads_row_slices", False)

    @property
    def merged(self) -> bool:
        return self._merged is not None

    @property
    def weight_changed(self) -> bool:
        """Whether merging changed the base weight (some adapter has a non-zero scaling)."""
        return self._merged is not None and any(s != 0 for _, s in self._merged)

    def scaling(self, name: str) -> float:
        return self.adapters[name].scaling(self.scales[name])

    def original_bytes_to_keep(self) -> int:
        """Host bytes a merge now would add to keep the original weight (and FP8 scale) for `unmerge`:
        none when they are kept already or no adapter changes the weight."""
        if self._original or all(self.scaling(name) == 0 for name in self.adapters):
            return 0
        kept = (self.base_layer.weight, getattr(self.base_layer, "weight_scale", None))
        return sum(t.numel() * t.element_size() for t in kept if t is not None)

    def branch_active(self) -> bool:
        """Whether the forward adds a LoRA branch (and so reads the unquantized input)."""
        if self.merged or not self.adapters:
            return False
        return self.numerics is Numerics.REFERENCE or self._stacked is not None

    def quant_spec(self) -> QuantSpec | None:
        """The base layer's quantized input, plus `y` while a branch runs beside it."""
        spec = quant_consumer_spec(self.base_layer)
        if spec is None or not self.branch_active():
            return spec
        return replace(spec, needs_unquantized_input=True, unquantized_reason="LoRA branch")

    def add_adapter(self, name: str, factors: LoraFactors) -> None:
        self.adapters[name] = factors
        self.refresh()

    def remove_adapter(self, name: str) -> None:
        del self.adapters[name]
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the contract branch's stacked factors: [A_1; A_2; ...] and [s_1 B_1, s_2 B_2, ...]."""
        live = [(f, self.scaling(n)) for n, f in self.adapters.items() if self.scaling(n) != 0]
        if not live:
            self._stacked = None
            return
        down = torch.cat([f.down for f, _ in live])
        up = torch.cat([(f.up.float() * s).to(f.up.dtype) for f, s in live], dim=1)
        self._stacked = (down, up)

    def delta_weight(self) -> torch.Tensor | None:
        """fp32 `sum(scaling * B @ A)` over the adapters with a non-zero scaling (None when there is none), on
        the layer's device (a streamed layer keeps its factors in host memory between steps)."""
        delta = None
        for name, f in self.adapters.items():
            s = self.scaling(name)
            if s != 0:
                term = (f.up.to(self.device).float() @ f.down.to(self.device).float()) * s
                delta = term if delta is None else delta + term
        return delta

    @torch.no_grad()
    def merge(self, keep_original: bool = True) -> None:
        """Fold the adapters, at their current scales, into the base weight (no-op when already so).
        The weight from before the first merge is kept on the host (once) for `unmerge`."""
        key = tuple((name, self.scaling(name)) for name in self.adapters)
        if self._merged == key:
            return
        self._restore()
        self.merge_stats = None
        delta = self.delta_weight()
        base = self.base_layer
        if delta is not None:
            fp8 = isinstance(base, (Fp8Linear, Fp8WeightOnlyLinear))
            if keep_original and not self._original:
                kept = (base.weight, base.weight_scale) if fp8 else (base.weight,)
                self._original = tuple(t.detach().to("cpu", copy=True) for t in kept)
            if isinstance(base, Fp8Linear):
                self.merge_stats = _merge_fp8(base, delta)
            elif isinstance(base, Fp8WeightOnlyLinear):
                self.merge_stats = _merge_weight_only(base, delta)
            else:  # computed where the delta is, written back wherever the weight waits
                base.weight.copy_((base.weight.to(delta.device).float() + delta).to(base.weight.dtype))
        self._merged = key

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the weight from before `merge`, bit for bit, and drop the host copy."""
        self._restore()
        self._original, self._merged, self.merge_stats = (), None, None

    def _restore(self) -> None:
        targets = (self.base_layer.weight, getattr(self.base_layer, "weight_scale", None))
        for target, original in zip(targets, self._original, strict=False):
            target.copy_(original)

    def stream_state(self) -> dict[tuple[str, ...], torch.Tensor]:
        """The tensors its forward reads besides its base layer's (each adapter's factors, the stacked branch
        factors), for models/streaming.py to keep in host memory between calls like the weights."""
        state = {}
        for name, f in self.adapters.items():
            state["adapter", name, "down"], state["adapter", name, "up"] = f.down, f.up
        if self._stacked is not None:
            state["stacked", "down"], state["stacked", "up"] = self._stacked
        return state

    def load_stream_state(self, state: dict[tuple[str, ...], torch.Tensor]) -> None:
        """Hold these tensors in the places `stream_state` named."""
        for key, tensor in state.items():
            if key[0] == "adapter":
                self.adapters[key[1]] = replace(self.adapters[key[1]], **{key[2]: tensor})
            else:
                down, up = self._stacked
                self._stacked = (tensor, up) if key[1] == "down" else (down, tensor)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        result = self.base_layer(x)
        if not self.branch_active():
            return result
        if isinstance(x, QuantizedActivation):
            if x.unquantized is None:
                raise RuntimeError(
                    "the LoRA branch needs the unquantized input; the producer did not write it"
                )
            x = x.unquantized
        if self.numerics is Numerics.REFERENCE:
            result_dtype = result.dtype
            for name, f in self.adapters.items():
                x = x if x.dtype == f.down.dtype else x.to(f.down.dtype)
                result = result + F.linear(F.linear(x, f.down), f.up) * self.scaling(name)
            return result.to(result_dtype)
        down, up = self._stacked
        hidden = F.linear(x, down)
        result.view(-1, self.out_features).addmm_(hidden.reshape(-1, down.shape[0]), up.t())
        return result

    def extra_repr(self) -> str:
        adapters = ", ".join(f"{n} (r={f.rank}, x{self.scales[n]:g})" for n, f in self.adapters.items())
        return f"adapters: {adapters}; {'merged' if self.merged else 'branch'}"


def _merge_fp8(base: Fp8Linear, delta: torch.Tensor) -> Fp8MergeStats:
    """Dequantize, add, requantize with a new per-tensor scale (`amax / 448`); input scale untouched. Runs
    where the delta is; the weight may wait in host memory (a streamed layer)."""
    merged = base.weight.to(delta.device).float() * base.weight_scale.float() + delta
    q, scale = quantize_weight(merged)
    stats = Fp8MergeStats(
        weights=merged.numel(),
        clipped=int(((merged / scale).abs() > FP8_MAX).sum()),
        max_abs_error=float((q.float() * scale - merged).abs().max()),
        scale_ratio=float(scale / base.weight_scale.float()),
    )
    base.weight.copy_(q)
    base.weight_scale.copy_(scale.reshape(base.weight_scale.shape))
    return stats


def _merge_weight_only(base: Fp8WeightOnlyLinear, delta: torch.Tensor) -> Fp8MergeStats:
    """Dequantize, add, requantize with new per-channel scales (each row's amax / 448); `scale_ratio` is the
    largest new / old channel scale."""
    old_scale = base.weight_scale.to(delta.device).float()
    merged = base.dequantized_weight(delta.device) + delta
    q, scale = quantize_per_channel(merged)
    stats = Fp8MergeStats(
        weights=merged.numel(),
        clipped=int(((merged / scale[:, None]).abs() > FP8_MAX).sum()),
        max_abs_error=float((q.float() * scale[:, None] - merged).abs().max()),
        scale_ratio=float((scale / old_scale).max()),
    )
    base.weight.copy_(q)
    base.weight_scale.copy_(scale)
    return stats


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """The mounted LoRA wrappers of `model`, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def lora_targets(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear a LoRA may target, by module name (a wrapper stands for its base layer)."""
    targets: dict[str, nn.Module] = {}
    inside: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if inside and name.startswith(inside):
            continue
        if isinstance(module, LoraLinear):
            targets[name], inside = module, (*inside, f"{name}.")
        elif isinstance(module, (nn.Linear, Fp8Linear, Fp8WeightOnlyLinear, Nvfp4Linear)):
            targets[name] = module
    return targets


def check_lora_fits(model: nn.Module, lora: LoraFile) -> dict[str, nn.Module]:
    """The target of every factor pair; CheckpointError naming the first key without a layer or of the
    wrong shape."""
    targets = lora_targets(model)
    found = {}
    for name, f in lora.factors.items():
        target = targets.get(name)
        if target is None:
            raise CheckpointError(
                f"LoRA file {lora.path}: {name}{DOWN} matches no linear layer of the transformer"
            )
        if isinstance(target, Nvfp4Linear):
            raise CheckpointError(
                f"LoRA file {lora.path}: {name} is an NVFP4 layer, and LoRAs on NVFP4 weights are not built: "
                "use the BF16 or FP8 checkpoint, or bake the LoRA in with quantize --lora"
            )
        if f.down.shape[1] != target.in_features or f.up.shape[0] != target.out_features:
            raise CheckpointError(
                f"LoRA file {lora.path}: {name} factors {list(f.down.shape)} and {list(f.up.shape)} do not "
                f"fit the layer's {target.in_features} inputs and {target.out_features} outputs"
            )
        found[name] = target
    return found


def mount_lora(
    model: nn.Module,
    name: str,
    lora: LoraFile,
    scales: Mapping[str, float],
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> int:
    """Add adapter `name` (its scale in `scales`) to every layer `lora` targets, wrapping the layer first
    where needed; returns the number of layers. Everything is validated and copied to `device` (default: each
    layer's weight's) before the first layer changes."""
    targets = check_lora_fits(model, lora)
    placed = {}
    for module_name, f in lora.factors.items():
        target = targets[module_name]
        where = (target.base_layer if isinstance(target, LoraLinear) else target).weight.device
        where = where if device is None else device
        placed[module_name] = replace(f, down=f.down.to(where, dtype), up=f.up.to(where, dtype))
    for module_name, f in placed.items():
        target = targets[module_name]
        if not isinstance(target, LoraLinear):
            target = LoraLinear(target, scales, device)
            _set_module(model, module_name, target)
        target.add_adapter(name, f)
    return len(placed)


def unmount_lora(model: nn.Module, name: str) -> None:
    """Remove adapter `name`; a layer left without adapters gets its base layer back (weights restored)."""
    for module_name, wrapper in lora_layers(model).items():
        if name in wrapper.adapters:
            wrapper.unmerge()
            wrapper.remove_adapter(name)
            if not wrapper.adapters:
                _set_module(model, module_name, wrapper.base_layer)


@dataclass
class MergeReport:
    """The layers whose weights hold merged LoRAs, and what requantizing the FP8 ones did."""

    bf16_layers: int = 0
    fp8: dict[str, Fp8MergeStats] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.fp8:
            return f"LoRA merged into {self.bf16_layers} BF16 linears"
        weights = sum(s.weights for s in self.fp8.values())
        clipped = sum(s.clipped for s in self.fp8.values())
        worst = max(self.fp8.items(), key=lambda item: item[1].max_abs_error)
        return (
            f"LoRA merged into {self.bf16_layers} BF16 and {len(self.fp8)} FP8 linears; FP8 weights "
            f"requantized with new per-tensor scales (x{min(s.scale_ratio for s in self.fp8.values()):.3g} "
            f"to x{max(s.scale_ratio for s in self.fp8.values()):.3g}), input scales kept: {clipped} of "
            f"{weights} weights clipped at ±448, max |requantization error| {worst[1].max_abs_error:.3g} "
            f"({worst[0]})"
        )


def configure_loras(model: nn.Module, merge: bool) -> MergeReport | None:
    """Put every LoRA layer in branch or merged mode; the merge report when merged."""
    layers = lora_layers(model)
    report = MergeReport() if merge and layers else None
    for name, wrapper in layers.items():
        if not merge:
            wrapper.unmerge()
            continue
        wrapper.merge()
        if wrapper.merge_stats is not None:
            report.fp8[name] = wrapper.merge_stats
        elif wrapper.weight_changed:
            report.bf16_layers += 1
    return report


def merge_host_bytes(model: nn.Module) -> int:
    """Host bytes merging `model`'s LoRA layers now would add to keep their original weights."""
    return sum(wrapper.original_bytes_to_keep() for wrapper in lora_layers(model).values())


def bake_loras(model: nn.Module) -> int:
    """Merge every LoRA into its base weight for good and unwrap the layers; returns how many."""
    layers = lora_layers(model)
    for name, wrapper in layers.items():
        wrapper.merge(keep_original=False)
        _set_module(model, name, wrapper.base_layer)
    return len(layers)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    (model.get_submodule(parent) if parent else model).register_module(child, module)
