"""Loading a pipeline: one local diffusers-layout checkpoint of any registered family (or the embedded
default) onto one device, its weights placed for a GPU-memory budget, this process one rank of a parallel
plan when launched as one; and the one-call API (`load_pipeline`, `generate`)."""

from pathlib import Path

import PIL.Image
import torch

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.pipelines.load_options import LoadOptions
from qwen_image_fusion.pipelines.memory import GpuMemory, plan_for
from qwen_image_fusion.pipelines.parallel import ParallelPlan, join_ranks, resolve_plan
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.precision import check_dtype, pick_device, pick_numerics
from qwen_image_fusion.pipelines.variants import AUTO


def load(options: LoadOptions) -> Pipeline:
    """Load a local diffusers-layout checkpoint of any registered family, or the embedded default
    (`options.model` None). Every option and config is checked before any weight is read. A parallel
    plan makes this process one rank of a launched group (refused before loading when it does not
    fit). On CUDA the weights are placed for `gpu_memory` (bytes or a size such as "24GiB"; default:
    what the device has free) and the largest request `workload` (default: the checkpoint's default
    size): see pipelines/memory_plan.py. On a CPU an explicit `gpu_memory` places them the same way,
    the CPU standing in for the device (what the CI tests run)."""
    plan = resolve_plan(options.parallel, options.model)
    device = pick_device(options.device)
    if plan is not None:
        device = join_ranks(device)
    spec = inspect_checkpoint(options.model)
    chosen, precision = pick_numerics(spec.weights, options.variant, device, options.dtype)
    gpu_memory, workload = options.gpu_memory, options.workload
    planned = plan_for(spec, precision.dtype, precision.vae_dtype, device, gpu_memory, workload)
    if plan is not None and planned is not None and not planned[1].resident:
        raise InputError("weights streamed for a GPU-memory budget do not combine with several GPUs yet")
    host = planned is not None and not planned[1].resident  # load on the host, place from there
    model = spec.family.load(
        spec, precision.dtype, torch.device("cpu") if host else device, precision.vae_dtype
    )
    memory = None
    if planned is not None:
        model.device = device
        memory = GpuMemory.for_model(model, *planned)
    pipe = Pipeline(model, spec, precision, chosen, memory)
    if plan is not None:
        pipe.set_parallel(plan)
    return pipe


_CACHE: dict[LoadOptions, Pipeline] = {}


def load_pipeline(
    model: str | Path | None = None,
    variant: str = AUTO,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    parallel: ParallelPlan | str | None = None,
    gpu_memory: int | str | None = None,
    workload: Workload | None = None,
) -> Pipeline:
    """A new pipeline for `model` (None: the embedded default); the options of `LoadOptions`
    (docs/API.md)."""
    return load(LoadOptions(model, variant, device, dtype, parallel, gpu_memory, workload))


def generate(
    prompt: str | list[str],
    model: str | Path | None = None,
    variant: str = AUTO,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    parallel: ParallelPlan | str | None = None,
    gpu_memory: int | str | None = None,
    **kwargs,
) -> list[PIL.Image.Image]:
    """One-call generation (`Pipeline.generate`'s arguments); keeps one pipeline per load options."""
    options = LoadOptions(model, variant, device, check_dtype(dtype), parallel, gpu_memory)
    if options not in _CACHE:
        _CACHE[options] = load(options)
    return _CACHE[options].generate(prompt, **kwargs)
