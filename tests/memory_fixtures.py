"""A pipeline placed with an explicit placement, for the CPU and GPU tests of GPU-memory plans, and a link
whose copies run as late as a side stream may run them."""

from pathlib import Path

import torch

from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.memory import DECODE, DENOISE, ENCODE, Workload
from qwen_image_fusion.models.streaming import HostLink, Link
from qwen_image_fusion.pipelines.memory import DTYPE_BYTES, GpuMemory
from qwen_image_fusion.pipelines.memory_plan import RESIDENT, STREAM, GiB, MemoryPlan, Placement, place_part
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.precision import Precision

FP32 = Precision(torch.float32, torch.float32, "diffusers' arithmetic, fast on a CPU")


def placed_pipeline(
    model_dir: Path | None,
    variant: str,
    text: tuple[str, int],
    transformer: int | None,
    link: Link,
    precision: Precision,
    budget: int = 64 * GiB,
    lend: bool = False,
) -> Pipeline:
    """A checkpoint on `link`'s device with an explicit placement: the text encoder (mode, layers kept in
    its phase), `transformer` blocks resident (None: all; with `lend`, those holding the offloaded text
    encoder's buffer lend it their memory), in `precision` (a resident pipeline's, to compare with it).
    Loaded on the host, placed from there, as
    `load_pipeline(gpu_memory=...)` does when the plan is not all resident."""
    spec = inspect_checkpoint(model_dir)
    model = spec.family.load(spec, precision.dtype, torch.device("cpu"), precision.vae_dtype)
    model.device = link.device
    profile = spec.family.memory_profile(spec, DTYPE_BYTES[precision.dtype], DTYPE_BYTES[precision.vae_dtype])
    text_part, dit, vae = (profile.part(p) for p in (ENCODE, DENOISE, DECODE))
    resident = len(dit.blocks) if transformer is None else transformer
    text_placement = place_part(text_part, text[0], text[1])
    need = text_placement.during() - text_placement.always() if lend else 0
    placements = (
        text_placement,
        place_part(dit, RESIDENT if resident == len(dit.blocks) and not need else STREAM, resident, need),
        Placement(vae, RESIDENT),
    )
    graphs = link.device.type == "cuda"
    plan = MemoryPlan(budget, Workload(64, 64), placements, False, graphs, fixed_reserve=0)
    memory = GpuMemory(model, profile, plan, link)
    memory.place()
    return Pipeline(model, spec, precision, variant, memory)


class LateLink(HostLink):
    """The CPU as the device, with every copy run as late as a side stream may run it: queued, and run when
    compute waits for an event recorded after it (or joins)."""

    def __init__(self) -> None:
        self.queue: list = []

    def event(self) -> object:
        return object()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queue.append(lambda: dst.copy_(src))

    def after_copies(self, event: object) -> None:
        self.queue.append(event)

    def compute_waits(self, event: object) -> None:
        """Waits for the event's latest record, as CUDA does (an earlier one may still be queued when a
        block that would have waited for it did not run)."""
        latest = max((i for i, item in enumerate(self.queue) if item is event), default=None)
        if latest is None:
            return  # recorded and passed already
        done, self.queue = self.queue[: latest + 1], self.queue[latest + 1 :]
        for item in done:
            if callable(item):
                item()

    def join(self) -> None:
        while self.queue:
            item = self.queue.pop(0)
            if callable(item):
                item()
