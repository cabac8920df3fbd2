"""Variant specs: which pipeline configuration a side of the comparison runs.

Grammar: `NAME[+fast-decode][+cache:PRESET][:DEVICE[:INDEX]][:DTYPE]`
  NAME    a variant of `qwen_image_fusion.pipelines.VARIANTS` (reference, contract, fp8-unfused,
          fp8-fused, nvfp4, nvfp4-w4a4-unfused, nvfp4-w4a4-fused) or auto
  +fast-decode  the VAE's opt-in 2D decode (models/vae_decode.py: approximate); default: the exact decode
  PRESET  a step-cache preset (models/cache_presets.py: fast, faster); default: no cache
  DEVICE  cpu or cuda, optionally with a GPU index (cuda:1); default: the pipeline's (CUDA when available)
  DTYPE   bf16 or fp32; default: the pipeline's (bf16)
Examples: `contract`, `fp8-fused:cuda`, `reference:cpu:fp32`, `contract:cuda:1:bf16`, `auto:bf16`,
`fp8-fused+cache:fast`, `contract+cache:faster:cpu:fp32`, `fp8-fused+fast-decode:cuda`.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from qwen_image_fusion.models.cache_presets import CACHE_PRESETS
from qwen_image_fusion.models.errors import InputError

DEVICES = ("cpu", "cuda")
DTYPES = ("bf16", "fp32")
CACHE_SUFFIX = "+cache"
FAST_DECODE = "+fast-decode"


@dataclass(frozen=True)
class VariantSpec:
    text: str
    name: str
    device: str | None = None
    dtype: str | None = None
    cache: str | None = None  # a step-cache preset's name
    fast_decode: bool = False  # the VAE's 2D decode


def parse_variant(text: str, known: Sequence[str]) -> VariantSpec:
    """Parse one variant spec; `known` lists the accepted names. Raises InputError."""
    name, *rest = text.strip().split(":")
    fast_decode = FAST_DECODE in name
    name = name.replace(FAST_DECODE, "")
    cache = None
    if name.endswith(CACHE_SUFFIX):
        name = name.removesuffix(CACHE_SUFFIX)
        cache = rest.pop(0) if rest else ""
        if cache not in CACHE_PRESETS:
            raise InputError(f"bad variant {text!r}: +cache:PRESET needs one of {', '.join(CACHE_PRESETS)}")
    if name not in known:
        raise InputError(f"unknown variant {name!r} in {text!r}; choose one of {', '.join(known)}")
    device = dtype = None
    for token in rest:
        if token in DTYPES and dtype is None:
            dtype = token
        elif token in DEVICES and device is None and dtype is None:
            device = token
        elif token.isdigit() and device == "cuda" and dtype is None:
            device = f"cuda:{token}"
        else:
            raise InputError(
                f"bad variant {text!r}: unexpected {token!r}; "
                "expected NAME[:DEVICE[:INDEX]][:DTYPE] with DEVICE cpu|cuda and DTYPE bf16|fp32"
            )
    return VariantSpec(text=text, name=name, device=device, dtype=dtype, cache=cache, fast_decode=fast_decode)
