"""Where and in what dtypes a pipeline runs: the device, the dtype asked for or picked for it (BF16 where the
device computes it natively), and the variant `auto` resolves to there."""

import os
from dataclasses import dataclass

import torch

from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines.variants import Variant, resolve_variant

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class Precision:
    """The dtypes a pipeline runs in: the transformer and text encoder (`dtype`) and the VAE, and why."""

    dtype: torch.dtype
    vae_dtype: torch.dtype
    reason: str

    def describe(self) -> str:
        names = str(self.dtype).removeprefix("torch."), str(self.vae_dtype).removeprefix("torch.")
        dtypes = names[0] if names[0] == names[1] else f"{names[0]} (VAE {names[1]})"
        return f"{dtypes}: {self.reason}"


def pick_device(device: str | torch.device | None) -> torch.device:
    """CUDA when available (or asked for), else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise InputError(f"device {device!r} is not a device: use cuda or cpu") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was requested but CUDA is not available on this machine")
    return device


def check_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype given as a name or a torch dtype (None: chosen for the device); InputError otherwise."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise InputError(f"unsupported dtype {dtype!r}: use bf16 or fp32")


CPU_DTYPE_ENV = "QWEN_IMAGE_CPU_DTYPE"


def cpu_dtype_override() -> str | None:
    """`QWEN_IMAGE_CPU_DTYPE` when set: the CPU defaults are picked as on a CPU with (`bf16`) or without
    (`fp32`) native BF16, whatever this CPU has; CI runs the dtype-dependent tests under both."""
    forced = os.environ.get(CPU_DTYPE_ENV, "")
    if forced and forced not in ("bf16", "fp32"):
        raise InputError(
            f"{CPU_DTYPE_ENV}={forced!r} is not bf16 or fp32 (unset: what this CPU computes natively)"
        )
    return forced or None


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes BF16 natively: every CUDA GPU we run on; a CPU with AVX-512 BF16 or AMX (or
    as `QWEN_IMAGE_CPU_DTYPE` says)."""
    if device.type != "cpu":
        return True
    forced = cpu_dtype_override()
    if forced is not None:
        return forced == "bf16"
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pick_precision(dtype: torch.dtype | None, device: torch.device, variant: Variant) -> Precision:
    """`dtype` when given, for every component. Else BF16 where the device computes it natively; on a CPU
    without native BF16 (BF16 convolutions and matmuls several times slower than FP32) the VAE runs in FP32,
    and so does the transformer unless its variant is defined in BF16 (contract, FP8 and NVFP4 numerics)."""
    if dtype is not None:
        return Precision(dtype, dtype, "as asked (--dtype)")
    forced = cpu_dtype_override() if device.type == "cpu" else None
    if native_bf16(device):
        how = f"{CPU_DTYPE_ENV}=bf16: as on a CPU with native BF16" if forced else "computes BF16 natively"
        return Precision(torch.bfloat16, torch.bfloat16, f"{device.type} {how}")
    why = f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native BF16"
    if forced:
        why = f"{CPU_DTYPE_ENV}=fp32: as on a CPU with no native BF16"
    if variant.numerics == "contract":
        return Precision(
            torch.bfloat16, torch.float32, f"{why}; the {variant.name} variant is defined in BF16"
        )
    return Precision(torch.float32, torch.float32, why)


def pick_numerics(
    weights: WeightFormat, variant: str, device: torch.device, dtype: str | torch.dtype | None = None
) -> tuple[Variant, Precision]:
    """The variant `variant` resolves to and the dtypes it runs in on `device`: where BF16 is slow (a CPU
    without native BF16, no dtype given) `auto` prefers diffusers' arithmetic in FP32."""
    dtype = check_dtype(dtype)
    chosen = resolve_variant(variant, weights, prefer_reference=dtype is None and not native_bf16(device))
    return chosen, pick_precision(dtype, device, chosen)
