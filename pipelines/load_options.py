"""How a pipeline is loaded, declared once: the options `load_pipeline` takes and every front end (the CLI,
the web demo, the HTTP server, `generate()`) passes on. Torch-free, so a command builds them before any
model loads."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.pipelines.variants import AUTO


@dataclass(frozen=True)
class LoadOptions:
    """docs/API.md `load_pipeline`: the checkpoint (None: the embedded default), the variant, the device and
    dtype (None: chosen for the device), a parallel plan ("auto" or a ParallelPlan: this process is one rank
    of a launched group), the GPU-memory budget and the largest request it must hold; `pipelines/loading.py`
    loads them. Hashable: the one-call `generate()` keeps one pipeline per options."""

    model: str | Path | None = None
    variant: str = AUTO
    device: str | None = None
    dtype: str | None = None
    parallel: Any = None
    gpu_memory: int | str | None = None
    workload: Workload | None = None
