"""Qwen-Image's ControlNet (InstantX Union): a few Qwen-Image blocks that read the control image's latents
and hand each main block a residual, with diffusers' `QwenImageControlNetModel` parameter names.

Its blocks are the transformer's own `QwenImageTransformerBlock`s, so FP8 checkpoints get the same fused
producer paths, decided once by the same gate. diffusers runs the ControlNet once per step on the positive
prompt and adds the same residuals in both CFG branches; the caller passes that prompt (DESIGN §15).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qwen_image_fusion.models.blocks import gate_blocks
from qwen_image_fusion.models.fusion import FusionReport
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.numerics import set_numerics
from qwen_image_fusion.models.qwen_image.config import ControlNetConfig
from qwen_image_fusion.models.qwen_image.math import Rope, joint_key_mask
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformerBlock, RMSNorm, TimeTextEmbed


@dataclass(frozen=True)
class ControlImage:
    """One control image at a step: its packed latents [B, tokens, C] and its conditioning scale at this
    step (a device scalar in FP32, 0 outside its guidance range, so CUDA graphs replay for any scale)."""

    latents: torch.Tensor
    scale: torch.Tensor


class QwenImageControlNet(nn.Module):
    """diffusers' `QwenImageControlNetModel` (one net; several control images run it once each and their
    scaled residuals add up, as `QwenImageMultiControlNetModel` does)."""

    def __init__(self, config: ControlNetConfig) -> None:
        super().__init__()
        self.config = config
        blocks = config.blocks
        dim = blocks.inner_dim
        self.time_text_embed = TimeTextEmbed(dim)
        self.txt_norm = RMSNorm(blocks.joint_attention_dim)
        self.img_in = nn.Linear(blocks.in_channels, dim)
        self.txt_in = nn.Linear(blocks.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            QwenImageTransformerBlock(dim, blocks.num_attention_heads, blocks.attention_head_dim)
            for _ in range(blocks.num_layers)
        )
        self.controlnet_blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks.num_layers))
        self.controlnet_x_embedder = nn.Linear(blocks.in_channels + config.extra_condition_channels, dim)
        self.quant_config: QuantConfig | None = None

    def set_numerics(self, numerics: Any) -> None:
        set_numerics(self, numerics)

    def post_load_weights(self, fuse: bool | None = None) -> FusionReport:
        """The transformer's gate over these blocks (FP8 scales, then each producer path)."""
        self.fusion_report = gate_blocks(self, fuse)
        return self.fusion_report

    def residuals(
        self,
        hidden_states: torch.Tensor,
        controls: list[ControlImage],
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        rope: Rope,
    ) -> list[torch.Tensor]:
        """One residual per block: each control image's block outputs, projected and scaled, summed over
        the images in order."""
        total: list[torch.Tensor] = []
        for control in controls:
            samples = self._block_samples(
                hidden_states,
                control.latents,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                timestep,
                rope,
            )
            # diffusers multiplies by a Python float: the product in FP32, rounded once to the model's dtype
            scaled = [(s.float() * control.scale).to(s.dtype) for s in samples]
            total = scaled if not total else [t + s for t, s in zip(total, scaled, strict=True)]
        return total

    def _block_samples(
        self,
        hidden_states: torch.Tensor,
        control_latents: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        rope: Rope,
    ) -> list[torch.Tensor]:
        image = self.img_in(hidden_states) + self.controlnet_x_embedder(control_latents)
        temb = self.time_text_embed(timestep, image.dtype)
        text = self.txt_in(self.txt_norm(encoder_hidden_states))
        mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.to(torch.bool)
        key_mask = joint_key_mask(mask, image.shape[1])
        samples = []
        for block, projection in zip(self.transformer_blocks, self.controlnet_blocks, strict=True):
            text, image = block(image, text, key_mask, temb, rope)
            samples.append(projection(image))
        return samples
