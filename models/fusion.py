"""The norm+quant fusion gate (DESIGN §4; NVFP4 W4A4: §19), decided once per producer path after loading.

A producer path is fused only when the device is a validated target of its consumers' format (FP8: Hopper
or Blackwell, NVFP4 W4A4: Blackwell; the CPU runs the twins of both), the producer can write that format,
every consumer accepts the quantized activation with one shared, valid scale, and any consumer that needs
the unquantized input can get it; per-token modulation rows (Edit-2511's `zero_cond_t`) are data the fused
kernels take. Every refusal is recorded with its reason, and so is a fused path that also writes the BF16
input (dual output), with the consumers' reason for needing it. A producer of NVFP4 W4A4 consumers runs its
NVFP4 binary fused or not (writing only y when not), so both paths share one LN reduction.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

from qwen_image_fusion.kernels.quant import inverse_scale
from qwen_image_fusion.models.env import env_flag
from qwen_image_fusion.models.fp8 import QuantSpec, quant_consumer_spec
from qwen_image_fusion.models.nvfp4 import NVFP4_KEY, w4a4_target_refusal

FUSION_ENV = "QWEN_IMAGE_FP8_FUSION"


@dataclass(frozen=True)
class ProducerQuant:
    """How a producer quantizes: the consumers' format, their scale and its inverse, whether it also writes
    `y`, and whether it writes the quantized activation at all (an unfused NVFP4 path writes only `y`, with
    the NVFP4 binary, so fused and unfused share its LN reduction)."""

    quant_key: str
    input_scale: torch.Tensor | None
    inv_scale: torch.Tensor | None
    write_y: bool
    write_q: bool = True


@dataclass(frozen=True)
class PathDecision:
    """The gate's verdict for one producer path: why it is unfused, or a note on how it is fused."""

    name: str
    fused: bool
    reason: str = ""


def fusion_enabled_by_env() -> bool:
    """`QWEN_IMAGE_FP8_FUSION=0` forces the unfused path (for parity runs)."""
    return env_flag(FUSION_ENV)


def fp8_target_refusal(device: torch.device) -> str:
    """Empty when `device` is a validated FP8 target, else why not.

    CUDA capability 9.0 (Hopper) and 10.x / 12.x (Blackwell) run the Triton kernels; the CPU runs
    the torch twins, which implement the same contract and make fused vs unfused testable anywhere.
    """
    if device.type == "cpu":
        return ""
    if device.type != "cuda":
        return f"device {device.type} is not a validated FP8 target"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) == (9, 0) or major in (10, 12):
        return ""
    return f"CUDA capability {major}.{minor} is not a validated FP8 target (9.0, 10.x, 12.x)"


def _scale_refusal(name: str, scale: torch.Tensor, device: torch.device) -> str:
    if scale.dtype != torch.float32:
        return f"input_scale of {name} is {str(scale.dtype).removeprefix('torch.')}, not float32"
    if scale.numel() != 1:
        return f"input_scale of {name} has {scale.numel()} elements, not 1"
    if scale.device != device:
        return f"input_scale of {name} is on {scale.device}, not {device}"
    value = float(scale.item())
    if not math.isfinite(value) or value <= 0:
        return f"input_scale of {name} is {value}, not finite and > 0"
    return ""


def gate_path(
    device: torch.device,
    consumers: list[tuple[str, nn.Module]],
    producer_writes_y: bool = True,
) -> tuple[str, QuantSpec | None, bool]:
    """(refusal reason or "", the shared spec, whether `y` must be written) for one producer path."""
    first_spec = next(filter(None, (quant_consumer_spec(m) for _, m in consumers)), None)
    nvfp4 = first_spec is not None and first_spec.quant_key == NVFP4_KEY
    reason = (w4a4_target_refusal if nvfp4 else fp8_target_refusal)(device)
    if reason:
        return reason, None, False
    specs = []
    for name, module in consumers:
        spec = quant_consumer_spec(module)
        if spec is None:
            what = "an NVFP4 W4A4" if nvfp4 else "a ModelOpt FP8"
            return f"consumer {name} is not {what} linear", None, False
        reason = _scale_refusal(name, spec.input_scale, device)
        if reason:
            return reason, None, False
        specs.append((name, spec))
    first_name, first = specs[0]
    for name, spec in specs[1:]:
        if spec.quant_key != first.quant_key or not torch.equal(spec.input_scale, first.input_scale):
            return (
                f"input scales of {first_name} and {name} differ "
                f"({first.input_scale.item():.6g} vs {spec.input_scale.item():.6g})",
                None,
                False,
            )
    needs_y = [name for name, spec in specs if spec.needs_unquantized_input]
    if needs_y and not producer_writes_y:
        return (
            f"consumer {needs_y[0]} needs the unquantized input, which this producer cannot write",
            None,
            False,
        )
    return "", first, bool(needs_y)


def configure_norm_quant(
    producer: nn.Module,
    path_name: str,
    consumers: list[tuple[str, nn.Module]],
    device: torch.device,
    enabled: bool,
) -> PathDecision:
    """Gate one producer path and set (or clear) `producer.quant` accordingly."""
    producer.quant = None
    specs = [spec for _, module in consumers if (spec := quant_consumer_spec(module)) is not None]
    if not specs:
        return PathDecision(path_name, False, "BF16 consumers (layer not quantized)")
    key = specs[0].quant_key
    if key not in producer.quant_keys:
        return PathDecision(path_name, False, f"the producer has no {key} kernel (its consumers quantize)")
    y_only = ProducerQuant(key, None, None, write_y=True, write_q=False) if key == NVFP4_KEY else None
    if not enabled:
        producer.quant = y_only
        return PathDecision(path_name, False, "fusion switched off (unfused path forced)")
    reason, spec, write_y = gate_path(device, consumers, producer.writes_y)
    if reason:
        producer.quant = y_only
        return PathDecision(path_name, False, reason)
    producer.quant = ProducerQuant(spec.quant_key, spec.input_scale, inverse_scale(spec.input_scale), write_y)
    return PathDecision(path_name, True, _dual_output_note(consumers) if write_y else "")


def _dual_output_note(consumers: list[tuple[str, nn.Module]]) -> str:
    """'dual output (LoRA branch needs y)': why the fused producer also writes the BF16 input."""
    specs = [quant_consumer_spec(module) for _, module in consumers]
    reasons = sorted({s.unquantized_reason or "a consumer" for s in specs if s.needs_unquantized_input})
    return f"dual output ({', '.join(reasons)} needs y)"


@dataclass(frozen=True)
class FusionReport:
    """All path decisions of a model: `block` paths (norm producers) and `mlp` paths (the MLP activation's
    producers, named by `mlp_label`), quantizing to `quant_label` (FP8, or NVFP4 on the W4A4 path)."""

    block: tuple[PathDecision, ...]
    mlp: tuple[PathDecision, ...]
    mlp_label: str = "GELU"
    quant_label: str = "FP8"

    @property
    def fused(self) -> int:
        return sum(d.fused for d in self.block)

    def summary(self) -> str:
        """'FP8 norm+quant fusion: N/240 block paths' plus the reasons for the rest."""
        lines = [f"{self.quant_label} norm+quant fusion: {self.fused}/{len(self.block)} block paths"]
        lines += _reasons(self.block)
        if self.mlp:
            fused = sum(d.fused for d in self.mlp)
            lines.append(
                f"{self.quant_label} {self.mlp_label}+quant fusion: {fused}/{len(self.mlp)} MLP paths"
            )
            lines += _reasons(self.mlp)
        return "\n".join(lines)


def _reasons(decisions: tuple[PathDecision, ...]) -> list[str]:
    """One line per distinct reason (unfused) or note (fused), with its path count and an example."""
    grouped: dict[tuple[bool, str], list[str]] = {}
    for d in decisions:
        if not d.fused or d.reason:
            grouped.setdefault((d.fused, d.reason), []).append(d.name)
    return [
        f"  {'fused' if fused else 'unfused'} ({len(names)}): {reason}; e.g. {names[0]}"
        for (fused, reason), names in grouped.items()
    ]
