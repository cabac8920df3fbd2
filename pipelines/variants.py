"""The pipeline variants as a typed table (torch-free, so the CLI checks `--variant` before loading).

A variant names the weights it runs on (BF16 or a ModelOpt FP8 export), the numerics of every producer
(qwen_image_fusion.kernels.numerics) and whether FP8 producers write quantized activations straight for their
consumers.
"""

from dataclasses import dataclass

from qwen_image_fusion.kernels.numerics import Numerics
from qwen_image_fusion.models.errors import InputError

AUTO = "auto"


@dataclass(frozen=True)
class Variant:
    name: str
    fp8_weights: bool  # runs on a ModelOpt FP8 checkpoint (else on BF16 weights)
    numerics: Numerics
    fused: bool  # FP8 producers fuse norm+modulate+quant where the gate allows


VARIANT_TABLE = (
    Variant("reference", fp8_weights=False, numerics=Numerics.REFERENCE, fused=False),
    Variant("contract", fp8_weights=False, numerics=Numerics.CONTRACT, fused=False),
    Variant("fp8-unfused", fp8_weights=True, numerics=Numerics.CONTRACT, fused=False),
    Variant("fp8-fused", fp8_weights=True, numerics=Numerics.CONTRACT, fused=True),
)
VARIANTS = tuple(v.name for v in VARIANT_TABLE)


def variants_for(fp8_weights: bool) -> tuple[Variant, ...]:
    """The variants a checkpoint can run, fastest last."""
    return tuple(v for v in VARIANT_TABLE if v.fp8_weights == fp8_weights)


def get_variant(name: str) -> Variant:
    """The variant called `name`; InputError naming the choices otherwise."""
    for variant in VARIANT_TABLE:
        if variant.name == name:
            return variant
    raise InputError(f"unknown variant {name!r}; choose from {', '.join((*VARIANTS, AUTO))}")


def resolve_variant(name: str, fp8_weights: bool, prefer_reference: bool = False) -> Variant:
    """The variant `name` asks for on a BF16 or FP8 checkpoint; "auto" is the fastest available (the
    reference arithmetic where `prefer_reference`: a CPU without native BF16 runs it in FP32). InputError
    saying what the checkpoint's weights allow otherwise."""
    available = variants_for(fp8_weights)
    if name == AUTO:
        return available[0] if prefer_reference and not fp8_weights else available[-1]
    variant = get_variant(name)
    if variant not in available:
        weights = "ModelOpt FP8" if fp8_weights else "BF16"
        raise InputError(
            f"variant {name!r} needs {'FP8' if variant.fp8_weights else 'BF16'} weights, and this checkpoint "
            f"has {weights} weights: choose from {', '.join(v.name for v in available)} or {AUTO}"
        )
    return variant
