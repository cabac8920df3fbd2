"""The pipeline variants as a typed table (torch-free, so the CLI checks `--variant` before loading).

A variant names the weights it runs on (BF16, a ModelOpt FP8 or NVFP4 export), the numerics of every
producer (qwen_image_fusion.kernels.numerics), whether quantizing producers write quantized activations
straight for their consumers, and for NVFP4 whether the activations are quantized too (W4A4, Blackwell's
FP4 tensor cores: unverified on hardware, so `auto` never picks it).
"""

from dataclasses import dataclass

from qwen_image_fusion.kernels.numerics import Numerics
from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import InputError

AUTO = "auto"
WEIGHTS_NAMED = {
    WeightFormat.BF16: "BF16",
    WeightFormat.FP8: "ModelOpt FP8",
    WeightFormat.NVFP4: "ModelOpt NVFP4",
}


@dataclass(frozen=True)
class Variant:
    name: str
    weights: WeightFormat  # the checkpoint weights it runs on
    numerics: Numerics
    fused: bool  # producers fuse norm+modulate+quant where the gate allows
    w4a4: bool = False  # NVFP4 activations too (CUDA capability 10 or later; the CPU runs the twins)


VARIANT_TABLE = (
    Variant("reference", WeightFormat.BF16, numerics=Numerics.REFERENCE, fused=False),
    Variant("contract", WeightFormat.BF16, numerics=Numerics.CONTRACT, fused=False),
    Variant("fp8-unfused", WeightFormat.FP8, numerics=Numerics.CONTRACT, fused=False),
    Variant("fp8-fused", WeightFormat.FP8, numerics=Numerics.CONTRACT, fused=True),
    # the weight path: BF16 activations, NVFP4 weights dequantized inside the GEMM (any GPU, the CPU)
    Variant("nvfp4", WeightFormat.NVFP4, numerics=Numerics.CONTRACT, fused=False),
    Variant("nvfp4-w4a4-unfused", WeightFormat.NVFP4, numerics=Numerics.CONTRACT, fused=False, w4a4=True),
    Variant("nvfp4-w4a4-fused", WeightFormat.NVFP4, numerics=Numerics.CONTRACT, fused=True, w4a4=True),
)
VARIANTS = tuple(v.name for v in VARIANT_TABLE)


def variants_for(weights: WeightFormat) -> tuple[Variant, ...]:
    """The variants a checkpoint of these weights can run, fastest verified one before the W4A4 ones."""
    return tuple(v for v in VARIANT_TABLE if v.weights is weights)


def get_variant(name: str) -> Variant:
    """The variant called `name`; InputError naming the choices otherwise."""
    for variant in VARIANT_TABLE:
        if variant.name == name:
            return variant
    raise InputError(f"unknown variant {name!r}; choose from {', '.join((*VARIANTS, AUTO))}")


def resolve_variant(name: str, weights: WeightFormat, prefer_reference: bool = False) -> Variant:
    """The variant `name` asks for on a checkpoint of these weights; "auto" is the fastest verified one (the
    reference arithmetic where `prefer_reference`: a CPU without native BF16 runs it in FP32; never W4A4).
    InputError saying what the checkpoint's weights allow otherwise."""
    available = variants_for(weights)
    if name == AUTO:
        verified = [v for v in available if not v.w4a4]
        return verified[0] if prefer_reference and weights is WeightFormat.BF16 else verified[-1]
    variant = get_variant(name)
    if variant not in available:
        raise InputError(
            f"variant {name!r} needs {variant.weights.name} weights, and this checkpoint has "
            f"{WEIGHTS_NAMED[weights]} weights: choose from {', '.join(v.name for v in available)} or {AUTO}"
        )
    return variant
