"""Numerics-aware modules share one protocol: a `numerics` attribute that `set_numerics` sets on each."""

from torch import nn

from qwen_image_fusion.kernels.numerics import Numerics


class NumericsAware:
    """Mixin of every module whose arithmetic follows a numerics mode (producers, q/k norms, LoRA layers)."""

    numerics: Numerics = Numerics.REFERENCE


def set_numerics(model: nn.Module, numerics: Numerics | str) -> None:
    """Select reference (diffusers op for op) or contract (DESIGN §4) arithmetic for every numerics-aware
    module of `model`."""
    numerics = Numerics(numerics)
    for module in model.modules():
        if isinstance(module, NumericsAware):
            module.numerics = numerics
