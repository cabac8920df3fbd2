"""Orchestration: the Qwen-Image text-to-image pipeline and its one-call API.

Names load lazily, so light users (argument parsing, `VARIANTS`) do not pay for importing
torch, diffusers and transformers.
"""

import importlib
from typing import Any

from pipelines.limits import VARIANTS

_LAZY = {
    "GenerationDefaults": "pipelines.qwen_image",
    "QwenImagePipeline": "pipelines.qwen_image",
    "RunInfo": "pipelines.qwen_image",
    "generate": "pipelines.qwen_image",
    "load_pipeline": "pipelines.qwen_image",
}
__all__ = ["VARIANTS", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
