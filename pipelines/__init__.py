"""Orchestration: the family-neutral pipeline and its one-call API.

Names load lazily, so light users (argument parsing, `VARIANTS`) do not pay for importing
torch, diffusers and transformers.
"""

import importlib
from typing import Any

from qwen_image_fusion.pipelines.variants import VARIANTS

_LAZY = {
    "GenerationDefaults": "qwen_image_fusion.models.family",
    "Pipeline": "qwen_image_fusion.pipelines.pipeline",
    "RunInfo": "qwen_image_fusion.pipelines.run_info",
    "generate": "qwen_image_fusion.pipelines.loading",
    "load_pipeline": "qwen_image_fusion.pipelines.loading",
}
__all__ = ["VARIANTS", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
