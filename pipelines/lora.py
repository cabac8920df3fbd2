"""The LoRAs of one pipeline as one object: load, stack, scale, switch mode and unload, never reloading
the base weights.

`LoraSet` owns the loaded files, each adapter's lasting scale (set by `load` and `set_scales`, as
diffusers' `set_adapters`) and the scale in force (one mapping, shared with every `LoraLinear` of
models/lora.py: the lasting scales, or a call's own for that call, as diffusers' per-call
`cross_attention_kwargs={"scale": ...}`), the mode ("branch" or "merge") and the merge report. It changes
the transformer's layers; the pipeline then re-syncs once (`Pipeline._resync`: branch or merge for the
variant, the FP8 fusion gate, captured CUDA graphs dropped).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from qwen_image_fusion.kernels.quant import FP8_MAX
from qwen_image_fusion.models.calibration import record_input_amax
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.fp8 import Fp8Linear
from qwen_image_fusion.models.lora import (
    MergeReport,
    bake_loras,
    configure_loras,
    lora_layers,
    merge_host_bytes,
    mount_lora,
    unmount_lora,
)
from qwen_image_fusion.models.lora_files import LoraConverter, LoraFile, read_lora_file
from qwen_image_fusion.pipelines.memory import check_host_room
from qwen_image_fusion.pipelines.presets import LORA_MODES, check_lora_scale, lora_name


@dataclass(frozen=True)
class LoadedLora:
    """A LoRA mounted on the pipeline's transformer, as `pipe.loras` reports it."""

    name: str
    path: Path
    scale: float
    layers: int


class LoraSet:
    """The LoRAs mounted on one transformer: files and layer counts by name, scales, mode, merge report."""

    def __init__(
        self, transformer: nn.Module, dtype: Any, convert: LoraConverter, device: Any = None
    ) -> None:
        self._transformer = transformer
        self._dtype = dtype
        self._device = device  # where LoRA math runs (None: each layer's weight's device)
        self._convert = convert
        self._files: dict[str, tuple[Path, int]] = {}  # name -> (path, layers)
        self.lasting: dict[str, float] = {}  # the scales a call without its own runs at
        self.scales: dict[str, float] = {}  # the scales in force: the one copy every LoraLinear reads
        self.mode = "branch"
        self.merge_report: MergeReport | None = None

    @property
    def loaded(self) -> dict[str, LoadedLora]:
        return {
            name: LoadedLora(name, path, self.lasting[name], layers)
            for name, (path, layers) in self._files.items()
        }

    def read(self, source: str | Path | LoraFile) -> LoraFile:
        """A LoRA file read and converted with this family's key conversion (a LoraFile passes through)."""
        return source if isinstance(source, LoraFile) else read_lora_file(source, self._convert)

    def load(self, source: str | Path | LoraFile, scale: float = 1.0, name: str | None = None) -> str:
        """Read (unless already read), validate and mount a LoRA; returns its name (default: file stem)."""
        if name is not None and (not isinstance(name, str) or not name):
            raise InputError(f"LoRA name {name!r} must be a non-empty string")
        if name in self._files:
            raise InputError(f"a LoRA named {name!r} is already loaded: unload it or pick another name")
        lora = self.read(source)
        name = lora_name(lora.path, self._files) if name is None else name
        scale = check_lora_scale(scale, name)
        self.apply(self.lasting)  # a mounted layer reads the scales in force: the lasting ones
        self.scales[name] = scale
        try:
            layers = mount_lora(self._transformer, name, lora, self.scales, self._dtype, self._device)
        except BaseException:
            del self.scales[name]
            raise
        if self.mode == "merge":
            try:
                self.check_merge_memory()
            except InputError:
                unmount_lora(self._transformer, name)
                del self.scales[name]
                raise
        self._files[name] = (lora.path, layers)
        self.lasting[name] = scale
        return name

    def set_scales(self, scales: dict[str, float]) -> bool:
        """Set the lasting scale of loaded LoRAs by name (all checked before any changes) and put them in
        force; whether the scales in force changed."""
        checked = self.checked(scales)
        self.lasting.update(checked)
        return self.apply(self.lasting)

    def apply_for_call(self, scales: dict[str, float]) -> bool:
        """Put in force the lasting scales with a call's own `scales` over them (checked first); whether
        the scales in force changed. The next call without scales runs at the lasting ones again."""
        return self.apply(self.lasting | self.checked(scales))

    def checked(self, scales: dict[str, float]) -> dict[str, float]:
        """`scales` of loaded LoRAs, each a finite number; InputError naming the first bad one."""
        return {self._check_loaded(name): check_lora_scale(scale, name) for name, scale in scales.items()}

    def apply(self, scales: dict[str, float]) -> bool:
        """Put `scales` (checked) in force, refreshing the layers whose scales changed; whether any did."""
        changed = {name: scale for name, scale in scales.items() if scale != self.scales[name]}
        self.scales.update(changed)
        for wrapper in lora_layers(self._transformer).values():
            if changed.keys() & wrapper.adapters.keys():
                wrapper.refresh()
        return bool(changed)

    def unload(self, name: str | None = None) -> None:
        """Unmount one LoRA (or all with None); layers left without LoRA get their original weights back."""
        for each in list(self._files) if name is None else [self._check_loaded(name)]:
            unmount_lora(self._transformer, each)
            del self._files[each], self.scales[each], self.lasting[each]

    def set_mode(self, mode: str) -> None:
        if mode not in LORA_MODES:
            raise InputError(f"LoRA mode {mode!r} is not one of {', '.join(LORA_MODES)}")
        if mode == "merge":
            self.check_merge_memory()
        self.mode = mode

    def check_merge_memory(self) -> None:
        """InputError, before anything changes, when merging now would keep more original weights in host
        memory than the host has available."""
        check_host_room(
            merge_host_bytes(self._transformer),
            "merging the LoRAs keeps {} of original weights in host memory",
            "use branch mode or free host memory",
        )

    def sync(self) -> None:
        """Branch or merge every LoRA layer as the mode says, keeping the merge report."""
        self.merge_report = configure_loras(self._transformer, self.mode == "merge")

    def bake(self) -> int:
        """Fold the loaded LoRAs into the BF16 weights for good (one fp32 sum, rounded once) and forget
        them, as `quantize --lora` does before calibration; returns the number of layers changed."""
        self.apply(self.lasting)
        layers = bake_loras(self._transformer)
        self._files.clear()
        self.scales.clear()
        self.lasting.clear()
        return layers

    def summary(self) -> str:
        """'LoRA (branch): name x0.8 on 24 layers, ...' or '' without LoRAs."""
        if not self._files:
            return ""
        items = ", ".join(
            f"{n} x{self.scales[n]:g} on {layers} layers" for n, (_, layers) in self._files.items()
        )
        return f"LoRA ({self.mode}): {items}"

    def _check_loaded(self, name: str) -> str:
        if name not in self._files:
            loaded = ", ".join(self._files) or "none"
            raise InputError(f"no LoRA named {name!r} is loaded (loaded: {loaded})")
        return name


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


def fp8_input_clipping(pipe: Any, prompt: str, **generate_kwargs: Any) -> InputClipping:
    """Generate once on the unfused FP8 path (eager) and report which inputs the calibrated scales clip:
    a LoRA changes the activations, while the input scales stay those calibrated without it."""
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
