"""Qwen-Image with a ControlNet: `QwenImageControlNetPipeline` (the InstantX Union ControlNet) or
`QwenImageControlNetInpaintPipeline` (the inpainting ControlNet, whose input also carries a mask): a
Qwen-Image checkpoint plus a `controlnet/` folder, checked against the transformer it guides before any
weight."""

from dataclasses import replace
from pathlib import Path

from qwen_image_fusion.models.checkpoint import read_json, transformer_weights
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.family import CheckpointSpec, FamilyModel, GenerationDefaults
from qwen_image_fusion.models.qwen_image.config import (
    CONTROLNET_INPAINT_PIPELINE_CLASS,
    CONTROLNET_PIPELINE_CLASS,
    ControlNetConfig,
    QwenImageConfig,
)
from qwen_image_fusion.models.qwen_image.family import QwenImageFamily

MATCHING = ("inner_dim", "attention_head_dim", "axes_dims_rope", "joint_attention_dim", "in_channels")


def check_controlnet(directory: Path, transformer: QwenImageConfig, pipeline_class: str) -> ControlNetConfig:
    """The `controlnet/` config of a checkpoint, refused in one line when its residuals or inputs could
    not meet the transformer's (widths, RoPE axes, text width, latent channels), when it is not the kind the
    pipeline class names (an inpainting ControlNet takes the mask's packed channels besides the latents), or
    when its weight format (BF16, FP8, NVFP4) differs from the transformer's."""
    where = directory / "controlnet" / "config.json"
    try:
        config = ControlNetConfig.from_dict(read_json(where))
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from None
    for name in MATCHING:
        theirs, ours = getattr(config.blocks, name), getattr(transformer, name)
        if theirs != ours:
            raise CheckpointError(f"{where}: {name} {theirs} differs from the transformer's {ours}")
    mask_channels = transformer.patch_size**2  # the mask, one channel, packed as the latents are
    wanted = mask_channels if pipeline_class == CONTROLNET_INPAINT_PIPELINE_CLASS else 0
    if config.extra_condition_channels != wanted:
        why = " (the mask's packed channels)" if wanted else ""
        raise CheckpointError(
            f"{where}: extra_condition_channels is {config.extra_condition_channels}, but a {pipeline_class} "
            f"ControlNet takes {wanted}{why}"
        )
    controlnet, transformer_format = (
        transformer_weights(directory / d) for d in ("controlnet", "transformer")
    )
    if controlnet != transformer_format:
        raise CheckpointError(
            f"{directory}: the controlnet's weights are {controlnet.name} and the transformer's "
            f"{transformer_format.name}: they must match (quantize writes both)"
        )
    return config


class QwenImageControlNetFamily(QwenImageFamily):
    name = "qwen-image-controlnet"
    pipeline_classes = (CONTROLNET_PIPELINE_CLASS, CONTROLNET_INPAINT_PIPELINE_CLASS)
    component_dirs = (*QwenImageFamily.component_dirs, "controlnet")

    def inspect(self, directory: Path, name: str) -> CheckpointSpec:
        spec = super().inspect(directory, name)
        transformer = QwenImageConfig.from_dict(read_json(directory / "transformer" / "config.json"))
        pipeline_class = read_json(directory / "model_index.json")["_class_name"]
        config = check_controlnet(directory, transformer, pipeline_class)
        return replace(spec, takes_control=True, control_inpaints=config.inpaints)

    def spec_for(self, model: FamilyModel, name: str, defaults: GenerationDefaults) -> CheckpointSpec:
        inpaints = model.components.controlnet.config.inpaints
        return replace(super().spec_for(model, name, defaults), takes_control=True, control_inpaints=inpaints)

    def memory_profile(self, spec: CheckpointSpec, dtype_bytes: int, vae_dtype_bytes: int):
        """None: memory plans do not place a ControlNet's blocks yet (everything loads onto the device)."""
        return None


FAMILY = QwenImageControlNetFamily()
