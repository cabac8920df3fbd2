"""Orchestration: the Qwen-Image text-to-image pipeline and its one-call API."""

from pipelines.qwen_image import (
    VARIANTS,
    GenerationDefaults,
    QwenImagePipeline,
    RunInfo,
    generate,
    load_pipeline,
)

__all__ = ["VARIANTS", "GenerationDefaults", "QwenImagePipeline", "RunInfo", "generate", "load_pipeline"]
