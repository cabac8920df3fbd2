"""`qwen-image quantize`: static calibration through the denoise loop, ModelOpt FP8 or NVFP4 export.

Input amax is recorded on every linear to be quantized while real prompts are denoised (with true
CFG, so both branches are seen; a checkpoint that edits runs image + instruction pairs); linears that read
one activation (the family's shared-input groups, e.g. the Q/K/V of a stream) share one input scale. FP8
weights get per-tensor amax scales and the family's recipe names the layers kept in BF16 (DESIGN §3); NVFP4
weights get E4M3 scales per 16 inputs under a global scale (DESIGN §19), and by default only the first two
and last two blocks stay BF16 beside everything outside the blocks. The result is a diffusers-layout
checkpoint whose `transformer/` is a ModelOpt export that this project and other ModelOpt consumers load;
the other components and the checkpoint's own generation defaults are those of the source.
"""

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from qwen_image_fusion.kernels.nvfp4 import NVFP4_BLOCK
from qwen_image_fusion.models.calibration import (
    fp8_state_dict,
    nvfp4_state_dict,
    quantizable_linears,
    record_input_amax,
    share_group_amax,
)
from qwen_image_fusion.models.checkpoint import QUANT_FORMATS, WeightFormat
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.family import CheckpointSpec, QuantRecipe
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
EDGE_BLOCKS = 2  # NVFP4's default keeps this many blocks at each end in BF16 (published NVFP4 recipes)


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


def nvfp4_fallback(recipe: QuantRecipe, part: nn.Module) -> tuple[str, ...]:
    """NVFP4's default BF16 rules for one denoising part: every linear outside its blocks, and its first
    and last `EDGE_BLOCKS` blocks whole (from the part's own block count: 60 in Qwen-Image, 32 in 2.1)."""
    count = len(part.transformer_blocks)
    edges = sorted({*range(min(EDGE_BLOCKS, count)), *range(max(count - EDGE_BLOCKS, 0), count)})
    return (*recipe.outside_blocks, *(f"transformer_blocks.{i}.*" for i in edges))


def quantization_configs(
    weights: WeightFormat, ignore: Sequence[str], weight_only: Sequence[str] = ()
) -> tuple[dict, dict]:
    """The flat `quantization_config` of config.json and the nested hf_quant_config.json of a ModelOpt
    export; `weight_only`: globs of the FP8 weight-only linears (our extension, models/fp8_weight_only.py)."""
    if weights is WeightFormat.FP8:
        tensor = {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"}
        group, size = {"input_activations": tensor, "weights": tensor}, {}
    else:
        block = {"num_bits": 4, "type": "float", "dynamic": False, "group_size": NVFP4_BLOCK}
        group, size = {"input_activations": block, "weights": block}, {"group_size": NVFP4_BLOCK}
    algo = weights.name
    quantization = {
        "quant_method": "modelopt",
        "quant_algo": algo,
        **size,
        "ignore": list(ignore),
        "producer": PRODUCER,
        "config_groups": {"group_0": {**group, "targets": ["Linear"]}},
    }
    nested = {"quant_algo": algo, **size, "exclude_modules": list(ignore)}
    if weight_only:
        quantization[WEIGHT_ONLY_KEY] = nested[WEIGHT_ONLY_KEY] = list(weight_only)
    return quantization, {"producer": PRODUCER, "quantization": nested}


def write_modelopt_transformer(
    model: nn.Module, state: dict[str, torch.Tensor], configs: tuple[dict, dict], directory: Path
) -> None:
    """config.json with the flat ModelOpt `quantization_config`, hf_quant_config.json, safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    flat, nested = configs
    config = model.config.to_dict() | {"quantization_config": flat}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "hf_quant_config.json").write_text(json.dumps(nested, indent=2))
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
    weights: str = WeightFormat.FP8,
) -> Path:
    """Calibrate `model` (None: the embedded default) and write its ModelOpt checkpoint to `out`, FP8 or
    NVFP4 (`weights`); `prompts` (text prompts or requests with images; None: the built-in set for the
    model) are checked against what the model takes before it loads; `loras` (file, scale) are baked into
    the BF16 weights first, `preset` sets the calibration run; `ignore` None keeps the format's default
    BF16 rules (`quantize_pipeline`); `fp8_modulation` stores the family's weight-only layers (Qwen-Image's
    modulation) in FP8 with per-channel scales instead of BF16."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"output {out} exists and is not an empty directory")
    weights = quant_format(weights, fp8_modulation)
    spec = inspect_checkpoint(model)
    get_preset(preset, spec.family.name)
    requests = default_calibration(spec) if prompts is None else as_requests(prompts)
    check_requests_for(requests, spec)
    # the contract variant is defined in BF16: calibration runs it, and its VAE, in BF16 on every device
    pipe = load_pipeline(model, variant="contract", device=device, dtype="bf16")
    for lora_file, scale in loras:
        pipe.load_lora(lora_file, scale)
    source = pipe.spec.directory
    return quantize_pipeline(
        pipe, out, requests, ignore, steps, size, seed, source, preset, fp8_modulation, weights
    )


def quant_format(weights: str, fp8_modulation: bool = False) -> WeightFormat:
    """The format `quantize` writes (`fp8` or `nvfp4`); InputError for another, or for FP8 weight-only
    modulation in an NVFP4 export."""
    if weights not in QUANT_FORMATS:
        raise InputError(f"unknown quantization format {weights!r}; choose from {', '.join(QUANT_FORMATS)}")
    if fp8_modulation and weights == WeightFormat.NVFP4:
        raise InputError("--fp8-modulation stores FP8 weight-only layers: it goes with --format fp8")
    return WeightFormat(weights)


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
    weights: str = WeightFormat.FP8,
) -> Path:
    """Calibrate a loaded BF16 pipeline on `prompts` (None: its built-in set) and write the FP8 or NVFP4
    checkpoint; its loaded LoRAs are baked into the weights first (so calibration sees the activations they
    cause); the other components (and the checkpoint's generation defaults) are copied from `source` when
    given, else saved from memory. Every part the model quantizes (the transformer, a ControlNet) is
    calibrated in the same runs and written to its folder. `ignore` None: FP8 keeps the family's BF16
    fallback list, NVFP4 what stays outside each part's blocks and its first and last two blocks."""
    weights = quant_format(weights, fp8_modulation)
    requests = default_calibration(pipe.spec) if prompts is None else as_requests(prompts)
    if not requests:
        raise InputError("no calibration prompts")
    if pipe.spec.weights is not WeightFormat.BF16:
        raise InputError(
            f"{pipe.model_name} is already an {pipe.spec.weights.name} checkpoint: quantize its BF16 source"
        )
    recipe = pipe.model.quantization
    weight_only_globs = recipe.weight_only if fp8_modulation else ()
    if fp8_modulation and not weight_only_globs:
        raise InputError(f"{pipe.model_name}: its family names no layers to store FP8 weight-only")
    run_preset = get_preset(preset, pipe.spec.family.name)
    steps = steps or (
        run_preset.num_inference_steps if run_preset else min(pipe.defaults.num_inference_steps, 20)
    )
    size = size or min(pipe.defaults.width, pipe.defaults.height)
    if pipe.loras:
        pipe.lora.bake()
        pipe.set_variant(pipe.variant)
    parts = pipe.model.denoise_parts()
    ignores = {folder: kept_bf16(recipe, module, weights, ignore) for folder, module in parts.items()}
    ignores = {
        folder: tuple(g for g in kept if g not in weight_only_globs) for folder, kept in ignores.items()
    }
    linears = {
        folder: quantizable_linears(module, (*ignores[folder], *weight_only_globs))
        for folder, module in parts.items()
    }
    weight_only = {
        folder: {
            n: m for n, m in quantizable_linears(module, ignores[folder]).items() if n not in linears[folder]
        }
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
        if weights is WeightFormat.FP8:
            state = fp8_state_dict(module, linears[folder], own, weight_only[folder])
        else:
            state = nvfp4_state_dict(module, linears[folder], own)
        configs = quantization_configs(weights, ignores[folder], weight_only_globs)
        write_modelopt_transformer(module, state, configs, out / folder)
    return out


def kept_bf16(
    recipe: QuantRecipe, part: nn.Module, weights: WeightFormat, ignore: Sequence[str] | None
) -> tuple[str, ...]:
    """The rules of the modules a part keeps in BF16: `ignore` when given, else the format's default."""
    if ignore is not None:
        return tuple(ignore)
    return recipe.bf16_fallback if weights is WeightFormat.FP8 else nvfp4_fallback(recipe, part)
