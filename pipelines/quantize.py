"""`qwen-image quantize`: static per-tensor FP8 calibration through the denoise loop, ModelOpt export.

Input amax is recorded on every linear to be quantized while real prompts are denoised (with true
CFG, so both branches are seen; a checkpoint that edits runs image + instruction pairs); weights get
per-tensor amax scales; linears that read one activation (the family's shared-input groups, e.g. the
Q/K/V of a stream) share one input scale. The family's
recipe names the layers kept in BF16. The result is a diffusers-layout checkpoint whose `transformer/`
is a ModelOpt FP8 export (DESIGN §3) that this project and other ModelOpt consumers load; the other
components and the checkpoint's own generation defaults are those of the source.
"""

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from qwen_image_fusion.models.calibration import (
    fp8_state_dict,
    quantizable_linears,
    record_input_amax,
    share_group_amax,
)
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.family import CheckpointSpec
from qwen_image_fusion.models.fp8_weight_only import WEIGHT_ONLY_KEY
from qwen_image_fusion.models.loading import save_tensors
from qwen_image_fusion.models.lora_files import LoraFile
from qwen_image_fusion.pipelines.loading import load_pipeline
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.presets import get_preset
from qwen_image_fusion.pipelines.requests import (
    Request,
    as_requests,
    builtin_edit_set,
    check_requests_for,
    edit_requests_for,
)

DEFAULT_CALIBRATION_PROMPTS = (
    "a red fox in fresh snow at sunrise, detailed fur",
    "a neon-lit street in Tokyo at night in the rain, reflections on the asphalt",
    "portrait of an elderly fisherman, weathered face, dramatic side light",
    "a bowl of ramen on a wooden table, steam, shallow depth of field",
    'a poster with the words "Qwen Image" in bold letters above a mountain landscape',
    "一只熊猫坐在竹林里吃竹子，水墨画风格",
    "isometric illustration of a tiny island with a lighthouse, pastel colors",
    "macro photograph of a dew drop on a green leaf",
)
PRODUCER = {"name": "qwen-image-fusion", "version": "0.1.0"}


def default_calibration(spec: CheckpointSpec) -> list[Request]:
    """The built-in calibration set of a checkpoint: the text prompts above, or for a model that edits,
    the built-in edit sets' image + instruction pairs it can take (pipelines/edit_sets); a ControlNet
    checkpoint adds the `control` set (an inpainting one `control-inpaint`), so its ControlNet sees control
    maps."""
    if spec.images_required:
        return edit_requests_for(spec.max_images)
    prompts = as_requests(DEFAULT_CALIBRATION_PROMPTS)
    if not spec.takes_control:
        return prompts
    return prompts + builtin_edit_set("control-inpaint" if spec.control_inpaints else "control")


def calibrate(
    pipe: Pipeline,
    linears: dict[str, nn.Linear],
    requests: Sequence[Request],
    steps: int,
    size: int,
    seed: int,
    preset: str | None = None,
) -> dict[str, torch.Tensor]:
    """Max |input| seen by each linear over all requests (prompts, edits of their images, img2img and
    inpainting from their start images, or ControlNet runs on control maps) and denoising steps (device
    tensors, no syncs); true CFG runs unless a preset turns it off."""
    graphs, pipe.cuda_graphs = pipe.cuda_graphs, False  # hooks must run on every step, not a replay
    try:
        with record_input_amax(linears) as amax:
            for i, request in enumerate(tqdm(requests, desc="calibrating", unit="prompt")):
                side = None if request.control else size  # a control map keeps its aspect (default area)
                pipe.generate(
                    request.prompt,
                    negative_prompt=" ",
                    width=side,
                    height=side,
                    num_inference_steps=steps,
                    seed=seed + i,
                    **request.generation_inputs(),
                    preset=preset,
                    output_type="latent",  # calibration needs the transformer's inputs, not pictures
                )
    finally:
        pipe.cuda_graphs = graphs
    return amax


def write_fp8_transformer(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    ignore: Sequence[str],
    directory: Path,
    weight_only: Sequence[str] = (),
) -> None:
    """config.json with a flat ModelOpt `quantization_config`, hf_quant_config.json, safetensors;
    `weight_only`: globs of the FP8 weight-only linears (our extension, models/fp8_weight_only.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    quantization = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "ignore": list(ignore),
        "producer": PRODUCER,
        "config_groups": {
            "group_0": {
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"},
                "weights": {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"},
                "targets": ["Linear"],
            }
        },
    }
    nested = {"quant_algo": "FP8", "exclude_modules": list(ignore)}
    if weight_only:
        quantization[WEIGHT_ONLY_KEY] = nested[WEIGHT_ONLY_KEY] = list(weight_only)
    config = model.config.to_dict() | {"quantization_config": quantization}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    hf_quant = {"producer": PRODUCER, "quantization": nested}
    (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    save_tensors({k: v.cpu() for k, v in state.items()}, directory)


def quantize_checkpoint(
    model: str | Path | None,
    out: Path,
    prompts: Sequence[str | Request] | None = None,
    ignore: Sequence[str] | None = None,
    steps: int | None = None,
    size: int | None = None,
    device: str | None = None,
    seed: int = 0,
    loras: Sequence[tuple[str | Path | LoraFile, float]] = (),
    preset: str | None = None,
    fp8_modulation: bool = False,
) -> Path:
    """Calibrate `model` (None: the embedded default) and write its FP8 ModelOpt checkpoint to `out`;
    `prompts` (text prompts or requests with images; None: the built-in set for the model) are checked
    against what the model takes before it loads; `loras` (file, scale) are baked into the BF16 weights
    first, `preset` sets the calibration run; `ignore` None keeps the family's BF16 fallback list;
    `fp8_modulation` stores the family's weight-only layers (Qwen-Image's modulation) in FP8 with
    per-channel scales instead of BF16."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"output {out} exists and is not an empty directory")
    spec = inspect_checkpoint(model)
    get_preset(preset, spec.family.name)
    requests = default_calibration(spec) if prompts is None else as_requests(prompts)
    check_requests_for(requests, spec)
    # the contract variant is defined in BF16: calibration runs it, and its VAE, in BF16 on every device
    pipe = load_pipeline(model, variant="contract", device=device, dtype="bf16")
    for lora_file, scale in loras:
        pipe.load_lora(lora_file, scale)
    source = pipe.spec.directory
    return quantize_pipeline(pipe, out, requests, ignore, steps, size, seed, source, preset, fp8_modulation)


def quantize_pipeline(
    pipe: Pipeline,
    out: Path,
    prompts: Sequence[str | Request] | None = None,
    ignore: Sequence[str] | None = None,
    steps: int | None = None,
    size: int | None = None,
    seed: int = 0,
    source: Path | None = None,
    preset: str | None = None,
    fp8_modulation: bool = False,
) -> Path:
    """Calibrate a loaded BF16 pipeline on `prompts` (None: its built-in set) and write the FP8 checkpoint;
    its loaded LoRAs are baked into the weights first (so calibration sees the activations they cause); the
    other components (and the checkpoint's generation defaults) are copied from `source` when given, else
    saved from memory. Every part the model quantizes (the transformer, a ControlNet) is calibrated in the
    same runs and written to its folder."""
    requests = default_calibration(pipe.spec) if prompts is None else as_requests(prompts)
    if not requests:
        raise InputError("no calibration prompts")
    if pipe.spec.fp8:
        raise InputError(f"{pipe.model_name} is already an FP8 checkpoint: quantize its BF16 source")
    recipe = pipe.model.quantization
    ignore = recipe.bf16_fallback if ignore is None else tuple(ignore)
    weight_only_globs = recipe.weight_only if fp8_modulation else ()
    if fp8_modulation and not weight_only_globs:
        raise InputError(f"{pipe.model_name}: its family names no layers to store FP8 weight-only")
    ignore = tuple(glob for glob in ignore if glob not in weight_only_globs)
    run_preset = get_preset(preset, pipe.spec.family.name)
    steps = steps or (
        run_preset.num_inference_steps if run_preset else min(pipe.defaults.num_inference_steps, 20)
    )
    size = size or min(pipe.defaults.width, pipe.defaults.height)
    if pipe.loras:
        pipe.lora.bake()
        pipe.set_variant(pipe.variant)
    parts = pipe.model.denoise_parts()
    linears = {
        folder: quantizable_linears(module, (*ignore, *weight_only_globs)) for folder, module in parts.items()
    }
    weight_only = {
        folder: {n: m for n, m in quantizable_linears(module, ignore).items() if n not in linears[folder]}
        for folder, module in parts.items()
    }
    every = {f"{folder}:{name}": m for folder, found in linears.items() for name, m in found.items()}
    amax = share_group_amax(calibrate(pipe, every, requests, steps, size, seed, preset), recipe.shared_inputs)
    if source is None:
        pipe.model.save(out, skip=tuple(parts), defaults=pipe.defaults)
    else:
        shutil.copytree(source, out, ignore=shutil.ignore_patterns(*parts), dirs_exist_ok=True)
    for folder, module in parts.items():
        own = {name: amax[f"{folder}:{name}"] for name in linears[folder]}
        state = fp8_state_dict(module, linears[folder], own, weight_only[folder])
        write_fp8_transformer(module, state, ignore, out / folder, weight_only_globs)
    return out
