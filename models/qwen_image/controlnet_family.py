"""Qwen-Image with a ControlNet (`QwenImageControlNetPipeline`: the InstantX Union ControlNet): a Qwen-Image
checkpoint plus a `controlnet/` folder, checked against the transformer it guides before any weight."""

from dataclasses import replace
from pathlib import Path

from models.checkpoint import is_fp8_transformer, read_json
from models.errors import CheckpointError
from models.family import CheckpointSpec, FamilyModel, GenerationDefaults
from models.qwen_image.config import CONTROLNET_PIPELINE_CLASS, ControlNetConfig, QwenImageConfig
from models.qwen_image.family import QwenImageFamily

MATCHING = ("inner_dim", "attention_head_dim", "axes_dims_rope", "joint_attention_dim", "in_channels")


def check_controlnet(directory: Path, transformer: QwenImageConfig) -> ControlNetConfig:
    """The `controlnet/` config of a checkpoint, refused in one line when its residuals or inputs could
    not meet the transformer's (widths, RoPE axes, text width, latent channels), when it is an inpainting
    ControlNet (extra condition channels: not built), or when its FP8 state differs from the transformer's."""
    where = directory / "controlnet" / "config.json"
    try:
        config = ControlNetConfig.from_dict(read_json(where))
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from None
    for name in MATCHING:
        theirs, ours = getattr(config.blocks, name), getattr(transformer, name)
        if theirs != ours:
            raise CheckpointError(f"{where}: {name} {theirs} differs from the transformer's {ours}")
    if config.extra_condition_channels:
        raise CheckpointError(
            f"{where}: extra_condition_channels {config.extra_condition_channels} is an inpainting "
            "ControlNet, which is not built yet (the Union ControlNet has none)"
        )
    if is_fp8_transformer(directory / "controlnet") != is_fp8_transformer(directory / "transformer"):
        raise CheckpointError(
            f"{directory}: the controlnet and the transformer must both be FP8 or both BF16 "
            "(quantize writes both)"
        )
    return config


class QwenImageControlNetFamily(QwenImageFamily):
    name = "qwen-image-controlnet"
    pipeline_classes = (CONTROLNET_PIPELINE_CLASS,)
    component_dirs = (*QwenImageFamily.component_dirs, "controlnet")

    def inspect(self, directory: Path, name: str) -> CheckpointSpec:
        spec = super().inspect(directory, name)
        transformer = QwenImageConfig.from_dict(read_json(directory / "transformer" / "config.json"))
        check_controlnet(directory, transformer)
        return replace(spec, takes_control=True)

    def spec_for(self, model: FamilyModel, name: str, defaults: GenerationDefaults) -> CheckpointSpec:
        return replace(super().spec_for(model, name, defaults), takes_control=True)

    def memory_profile(self, spec: CheckpointSpec, dtype_bytes: int, vae_dtype_bytes: int):
        """None: memory plans do not place a ControlNet's blocks yet (everything loads onto the device)."""
        return None


FAMILY = QwenImageControlNetFamily()
