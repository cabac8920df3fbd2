"""Transformer configuration: the fields of diffusers' `transformer/config.json` that shape the model."""

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from models.errors import CheckpointError


def env_flag(name: str) -> bool:
    """An on-by-default switch from the environment: `0`, `off`, `false` or `no` turn it off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "false", "no")


UNSUPPORTED_FLAGS = ("use_additional_t_cond", "use_layer3d_rope", "guidance_embeds")


@dataclass(frozen=True)
class QwenImageConfig:
    """Qwen-Image MMDiT hyper-parameters; defaults are the public 20B checkpoint (DESIGN §1)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    zero_cond_t: bool = False  # Edit-2511: reference-image tokens modulated from t = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.attention_head_dim != sum(self.axes_dims_rope):
            raise ValueError(
                f"attention_head_dim {self.attention_head_dim} must equal sum(axes_dims_rope) "
                f"{sum(self.axes_dims_rope)}"
            )
        if any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must be even")
        if self.in_channels != self.out_channels * self.patch_size**2:
            raise ValueError(
                f"in_channels {self.in_channels} must be out_channels*patch_size^2 "
                f"({self.out_channels * self.patch_size**2})"
            )
        if min(self.num_layers, self.num_attention_heads, self.joint_attention_dim) < 1:
            raise ValueError("num_layers, num_attention_heads and joint_attention_dim must be positive")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "QwenImageConfig":
        """Build from a diffusers config dict; refuses variant flags this model lacks (Qwen-Image-Layered's
        `use_additional_t_cond` / `use_layer3d_rope`, guidance embeddings)."""
        enabled = [flag for flag in UNSUPPORTED_FLAGS if raw.get(flag)]
        if enabled:
            raise CheckpointError(
                f"transformer config enables {', '.join(enabled)}: only the Qwen-Image and Qwen-Image-Edit "
                "architectures (zero_cond_t included) are supported"
            )
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        if "axes_dims_rope" in known:
            known["axes_dims_rope"] = tuple(known["axes_dims_rope"])
        if known.get("out_channels") is None:
            known.pop("out_channels", None)
        try:
            return cls(**known, extra={k: v for k, v in raw.items() if k not in names})
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"invalid transformer config: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """diffusers-compatible config.json content."""
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out["axes_dims_rope"] = list(self.axes_dims_rope)
        out["guidance_embeds"] = False
        out["_class_name"] = "QwenImageTransformer2DModel"
        return {**self.extra, **out}
