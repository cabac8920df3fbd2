"""Static calibration, for every family: hooks recording each linear's running max |input| (also the
input-clipping check), one input scale per group of linears reading one activation, and the ModelOpt
FP8 (DESIGN §3) and NVFP4 (§19) state dicts."""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from qwen_image_fusion.kernels.quant import FP8_MAX
from qwen_image_fusion.models.fp8 import MIN_AMAX, quantize_weight
from qwen_image_fusion.models.fp8_weight_only import quantize_per_channel
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.nvfp4 import input_scale_of, quantize_nvfp4_weight


@contextmanager
def record_input_amax(linears: dict[str, nn.Module]) -> Iterator[dict[str, torch.Tensor]]:
    """While active, the running max |input| of each linear (device scalars, no host syncs).

    On exit the hooks are removed, and a linear that never ran is an error.
    """
    amax: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            current = args[0].detach().abs().amax().float()
            amax[name] = current if name not in amax else torch.maximum(amax[name], current)

        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    try:
        yield amax
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(set(linears) - set(amax))
    if missing:
        raise RuntimeError(f"calibration never reached {missing[:3]}")


def quantizable_linears(model: nn.Module, ignore: Sequence[str]) -> dict[str, nn.Linear]:
    """The Linears that get quantized: every one no ignore rule matches."""
    config = QuantConfig("FP8", tuple(ignore))
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not config.ignores(n)}


def share_group_amax(
    amax: dict[str, torch.Tensor], groups: Sequence[Sequence[str]]
) -> dict[str, torch.Tensor]:
    """One input amax for the sibling linears of each group that read the same activation (Q/K/V)."""
    shared = dict(amax)
    for name in amax:
        prefix, _, leaf = name.rpartition(".")
        for group in groups:
            members = [f"{prefix}.{m}" if prefix else m for m in group]
            if leaf in group and all(m in amax for m in members):
                shared[name] = torch.stack([amax[m] for m in members]).max()
    return shared


def fp8_state_dict(
    model: nn.Module,
    linears: dict[str, nn.Linear],
    input_amax: dict[str, torch.Tensor],
    weight_only: dict[str, nn.Linear] | None = None,
) -> dict[str, torch.Tensor]:
    """The ModelOpt FP8 state dict (on the model's device): e4m3 weights, fp32 scalar scales, BF16 biases;
    the `weight_only` linears with one weight scale per output channel and no input scale."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    for name, linear in linears.items():
        state[f"{name}.weight"], state[f"{name}.weight_scale"] = quantize_weight(linear.weight.detach())
        state[f"{name}.input_scale"] = (input_amax[name].clamp_min(MIN_AMAX) / FP8_MAX).reshape(())
    for name, linear in (weight_only or {}).items():
        state[f"{name}.weight"], state[f"{name}.weight_scale"] = quantize_per_channel(linear.weight.detach())
    return state


def nvfp4_state_dict(
    model: nn.Module, linears: dict[str, nn.Linear], input_amax: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The ModelOpt NVFP4 state dict (on the model's device, no host read): packed E2M1 weights, E4M3 block
    scales, fp32 scalar `weight_scale_2` and `input_scale` (the inverse global encode scales of the weight's
    and the input's amax), BF16 biases."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    for name, linear in linears.items():
        packed, block_scale, weight_scale_2 = quantize_nvfp4_weight(linear.weight)
        state[f"{name}.weight"], state[f"{name}.weight_scale"] = packed, block_scale
        state[f"{name}.weight_scale_2"] = weight_scale_2
        state[f"{name}.input_scale"] = input_scale_of(input_amax[name])
    return state
