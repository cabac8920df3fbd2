"""Qwen-Image 2.1 transformer configuration: the fields of diffusers' `transformer/config.json`
(`QwenImage21Transformer2DModel`) that shape the model, checked when read."""

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from qwen_image_fusion.models.errors import CheckpointError

CLASS_NAME = "QwenImage21Transformer2DModel"
_POSITIVE_INTS = (
    "patch_size",
    "in_channels",
    "out_channels",
    "num_layers",
    "attention_head_dim",
    "num_attention_heads",
    "context_in_dim",
    "mlp_ratio",
)


@dataclass(frozen=True)
class QwenImage21Config:
    """2.1 DiT hyper-parameters; defaults are diffusers' (the released 7B model, DESIGN §7)."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int = 64
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096
    mlp_ratio: int = 3
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    eps: float = 1e-6
    causal_condition: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        axes = self.axes_dims_rope
        if len(axes) != 3 or any(type(d) is not int or d < 2 or d % 2 for d in axes):
            raise ValueError(f"axes_dims_rope must be three positive even integers, got {list(axes)}")
        if sum(axes) != self.attention_head_dim:
            raise ValueError(
                f"attention_head_dim {self.attention_head_dim} must equal sum(axes_dims_rope) {sum(axes)}"
            )
        if type(self.eps) not in (int, float) or not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be a finite number > 0, got {self.eps!r}")
        if type(self.causal_condition) is not bool:
            raise ValueError(f"causal_condition must be true or false, got {self.causal_condition!r}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        return self.inner_dim * self.mlp_ratio

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "QwenImage21Config":
        """Build from a diffusers config dict; another class or a bad value is refused in one line."""
        class_name = raw.get("_class_name", CLASS_NAME)
        if class_name != CLASS_NAME:
            raise CheckpointError(f"transformer config is for {class_name}, not {CLASS_NAME}")
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        if isinstance(known.get("axes_dims_rope"), list):
            known["axes_dims_rope"] = tuple(known["axes_dims_rope"])
        if known.get("out_channels") is None:  # diffusers: `out_channels or in_channels`
            known["out_channels"] = known.get("in_channels", cls.in_channels)
        try:
            return cls(**known, extra={k: v for k, v in raw.items() if k not in names})
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"invalid Qwen-Image 2.1 transformer config: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """diffusers-compatible config.json content."""
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out["axes_dims_rope"] = list(self.axes_dims_rope)
        out["_class_name"] = CLASS_NAME
        return {**self.extra, **out}
