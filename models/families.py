"""The registered model families, and which one serves a checkpoint (torch-free).

Adding a family is its package under models/ plus one line in FAMILY_MODULES; each module exposes
`FAMILY`, a `ModelFamily` naming the `model_index.json` classes it serves.
"""

import importlib
from functools import cache
from pathlib import Path

from qwen_image_fusion.models.checkpoint import read_model_index
from qwen_image_fusion.models.embedded import DEFAULT_MODEL_DIR, EMBEDDED_NAME
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.family import CheckpointSpec, ModelFamily

FAMILY_MODULES = (
    "qwen_image_fusion.models.qwen_image.family",
    "qwen_image_fusion.models.qwen_image.controlnet_family",
    "qwen_image_fusion.models.qwen_image_edit.family",
    "qwen_image_fusion.models.qwen_image21.family",
    "qwen_image_fusion.models.qwen_image_layered.family",
)


@cache
def registered_families() -> tuple[ModelFamily, ...]:
    return tuple(importlib.import_module(name).FAMILY for name in FAMILY_MODULES)


def family_for(pipeline_class: object, where: Path) -> ModelFamily:
    """The family serving a model_index.json `_class_name`; CheckpointError naming the ones served."""
    for family in registered_families():
        if pipeline_class in family.pipeline_classes:
            return family
    served = ", ".join(c for f in registered_families() for c in f.pipeline_classes)
    raise CheckpointError(
        f"{where}: pipeline class {pipeline_class!r} is not supported (supported: {served})"
    )


def inspect_checkpoint(model: str | Path | None) -> CheckpointSpec:
    """The spec of a local diffusers-layout checkpoint (None: the embedded default), from its configs only."""
    directory, name = (DEFAULT_MODEL_DIR, EMBEDDED_NAME) if model is None else (Path(model), str(model))
    index = read_model_index(directory)
    family = family_for(index.get("_class_name"), directory / "model_index.json")
    return family.inspect(directory, name)
