"""Loading a diffusers-layout Qwen-Image 2.1 transformer directory (BF16 or ModelOpt FP8)."""

from typing import Any

from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer


def build_transformer21(raw: dict[str, Any]) -> QwenImage21Transformer:
    """Our 2.1 DiT for a diffusers transformer config.json (a bad value is refused in one line); load its
    weights with `qwen_image_fusion.models.loading.load_transformer(directory, build_transformer21, dtype,
    device)`."""
    return QwenImage21Transformer(QwenImage21Config.from_dict(raw))
