"""LoRAs on a pipeline: load, stack, scale, switch mode and unload without reloading the base weights.

The pipeline keeps `loras` (name -> LoadedLora) and `lora_mode` ("branch" or "merge"); the adapters live
in the transformer's `LoraLinear` layers (models/lora.py). After each change the pipeline re-runs
`set_variant` on its current variant, which settles branch or merge for the variant's numerics
(`sync_loras`), re-runs the FP8 fusion gate and drops the captured CUDA graphs.
"""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kernels.quant import FP8_MAX
from kernels.seam import Numerics
from models.errors import InputError
from models.fp8 import Fp8Linear
from models.lora import (
    LoraFile,
    MergeReport,
    bake_loras,
    configure_loras,
    mount_lora,
    read_lora_file,
    set_lora_scale,
    unmount_lora,
)
from pipelines.presets import LORA_MODES, check_lora_scale, lora_name

if TYPE_CHECKING:
    from pipelines.qwen_image import QwenImagePipeline


@dataclass(frozen=True)
class LoadedLora:
    """A LoRA mounted on the pipeline's transformer."""

    name: str
    path: Path
    scale: float
    layers: int


def load_lora(
    pipe: "QwenImagePipeline", source: str | Path | LoraFile, scale: float = 1.0, name: str | None = None
) -> str:
    """Read (unless already read), validate and mount a LoRA; returns its name (default: the file stem)."""
    if name is not None and (not isinstance(name, str) or not name):
        raise InputError(f"LoRA name {name!r} must be a non-empty string")
    if name in pipe.loras:
        raise InputError(f"a LoRA named {name!r} is already loaded: unload it or pick another name")
    lora = source if isinstance(source, LoraFile) else read_lora_file(source)
    name = lora_name(lora.path, pipe.loras) if name is None else name
    scale = check_lora_scale(scale, name)
    layers = mount_lora(pipe.transformer, name, lora, scale, pipe.dtype)
    pipe.loras[name] = LoadedLora(name, lora.path, scale, layers)
    return name


def set_lora_scales(pipe: "QwenImagePipeline", scales: dict[str, float]) -> bool:
    """Set the scale of loaded LoRAs by name (all checked before any changes); whether any changed."""
    checked = {}
    for name, scale in scales.items():
        _check_loaded(pipe, name)
        checked[name] = check_lora_scale(scale, name)
    changed = {name: scale for name, scale in checked.items() if scale != pipe.loras[name].scale}
    for name, scale in changed.items():
        set_lora_scale(pipe.transformer, name, scale)
        pipe.loras[name] = replace(pipe.loras[name], scale=scale)
    return bool(changed)


def unload_lora(pipe: "QwenImagePipeline", name: str | None = None) -> None:
    """Unmount one LoRA (or all with None); layers left without LoRA get their original weights back."""
    names = list(pipe.loras) if name is None else [_check_loaded(pipe, name)]
    for each in names:
        unmount_lora(pipe.transformer, each)
        del pipe.loras[each]


def bake_into_weights(pipe: "QwenImagePipeline") -> int:
    """Fold the loaded LoRAs into the BF16 weights for good (one fp32 sum, rounded once) and forget them,
    as `quantize --lora` does before calibration; returns the number of layers changed."""
    layers = bake_loras(pipe.transformer)
    pipe.loras.clear()
    pipe.set_variant(pipe.variant)
    return layers


def check_lora_mode(mode: str) -> str:
    if mode not in LORA_MODES:
        raise InputError(f"LoRA mode {mode!r} is not one of {', '.join(LORA_MODES)}")
    return mode


def sync_loras(pipe: "QwenImagePipeline", variant: str) -> MergeReport | None:
    """Branch or merge every LoRA layer as `pipe.lora_mode` says, with the variant's numerics (PEFT's
    arithmetic in `reference`, the stacked two-GEMM branch otherwise); the merge report when merged."""
    numerics = Numerics.REFERENCE if variant == "reference" else Numerics.CONTRACT
    return configure_loras(pipe.transformer, pipe.lora_mode == "merge", numerics)


def lora_summary(pipe: "QwenImagePipeline") -> str:
    """'LoRA (branch): name x0.8 on 24 layers, ...' or '' without LoRAs."""
    if not pipe.loras:
        return ""
    items = ", ".join(f"{lora.name} x{lora.scale:g} on {lora.layers} layers" for lora in pipe.loras.values())
    return f"LoRA ({pipe.lora_mode}): {items}"


@dataclass(frozen=True)
class InputClipping:
    """How far each FP8 linear's inputs went beyond the range its calibrated input scale represents."""

    ratio: dict[str, float]  # max |x| / (448 * input_scale): above 1 the quantizer clips

    def summary(self) -> str:
        clipping = {name: r for name, r in self.ratio.items() if r > 1}
        if not clipping:
            return f"FP8 inputs: none of {len(self.ratio)} FP8 linears clipped by its calibrated input scale"
        worst = max(clipping, key=clipping.get)
        return (
            f"FP8 inputs: {len(clipping)} of {len(self.ratio)} FP8 linears clipped at ±448 by their "
            f"calibrated input scales (worst {worst}: max |x| is {clipping[worst]:.2f}x the range)"
        )


def fp8_input_clipping(pipe: "QwenImagePipeline", prompt: str, **generate_kwargs) -> InputClipping:
    """Generate once on the unfused FP8 path (eager) and report which inputs the calibrated scales clip:
    a LoRA changes the activations, while the input scales stay those calibrated without it."""
    from pipelines.quantize import record_input_amax

    linears = {n: m for n, m in pipe.transformer.named_modules() if isinstance(m, Fp8Linear)}
    if not linears:
        raise InputError(f"{pipe.model_name} has no FP8 linears")
    variant, graphs = pipe.variant, pipe.cuda_graphs
    pipe.set_variant("fp8-unfused")
    pipe.cuda_graphs = False
    try:
        with record_input_amax(linears) as amax:
            pipe.generate(prompt, **generate_kwargs)
    finally:
        pipe.cuda_graphs = graphs
        pipe.set_variant(variant)
    ratio = {n: float(amax[n] / (FP8_MAX * m.input_scale.float())) for n, m in linears.items()}
    return InputClipping({name.removesuffix(".base_layer"): r for name, r in ratio.items()})


def _check_loaded(pipe: "QwenImagePipeline", name: str) -> str:
    if name not in pipe.loras:
        loaded = ", ".join(pipe.loras) or "none"
        raise InputError(f"no LoRA named {name!r} is loaded (loaded: {loaded})")
    return name
