"""`qwen-image quantize`: static per-tensor FP8 calibration through the denoise loop, ModelOpt export.

Input amax is recorded on every linear to be quantized while real prompts are denoised (with true
CFG, so both branches are seen); weights get per-tensor amax scales; linears that read one activation
(the family's shared-input groups, e.g. the Q/K/V of a stream) share one input scale. The family's
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

from models.calibration import fp8_state_dict, quantizable_linears, record_input_amax, share_group_amax
from models.errors import InputError
from models.loading import save_tensors
from models.lora_files import LoraFile
from pipelines.pipeline import Pipeline, load_pipeline
from pipelines.presets import get_preset

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


def calibrate(
    pipe: Pipeline,
    linears: dict[str, nn.Linear],
    prompts: Sequence[str],
    steps: int,
    size: int,
    seed: int,
    preset: str | None = None,
) -> dict[str, torch.Tensor]:
    """Max |input| seen by each linear over all prompts and denoising steps (device tensors, no syncs);
    true CFG runs unless a preset turns it off."""
    graphs, pipe.cuda_graphs = pipe.cuda_graphs, False  # hooks must run on every step, not a replay
    try:
        with record_input_amax(linears) as amax:
            for i, prompt in enumerate(tqdm(prompts, desc="calibrating", unit="prompt")):
                pipe.generate(
                    prompt,
                    negative_prompt=" ",
                    width=size,
                    height=size,
                    num_inference_steps=steps,
                    seed=seed + i,
                    preset=preset,
                    output_type="latent",  # calibration needs the transformer's inputs, not pictures
                )
    finally:
        pipe.cuda_graphs = graphs
    return amax


def write_fp8_transformer(
    model: nn.Module, state: dict[str, torch.Tensor], ignore: Sequence[str], directory: Path
) -> None:
    """config.json with a flat ModelOpt `quantization_config`, hf_quant_config.json, safetensors."""
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
    config = model.config.to_dict() | {"quantization_config": quantization}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    hf_quant = {"producer": PRODUCER, "quantization": {"quant_algo": "FP8", "exclude_modules": list(ignore)}}
    (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    save_tensors({k: v.cpu() for k, v in state.items()}, directory)


def quantize_checkpoint(
    model: str | Path | None,
    out: Path,
    prompts: Sequence[str] = DEFAULT_CALIBRATION_PROMPTS,
    ignore: Sequence[str] | None = None,
    steps: int | None = None,
    size: int | None = None,
    device: str | None = None,
    seed: int = 0,
    loras: Sequence[tuple[str | Path | LoraFile, float]] = (),
    preset: str | None = None,
) -> Path:
    """Calibrate `model` (None: the embedded default) and write its FP8 ModelOpt checkpoint to `out`;
    `loras` (file, scale) are baked into the BF16 weights first, `preset` sets the calibration run;
    `ignore` None keeps the family's BF16 fallback list."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"output {out} exists and is not an empty directory")
    get_preset(preset)
    pipe = load_pipeline(model, variant="contract", device=device)
    for lora_file, scale in loras:
        pipe.load_lora(lora_file, scale)
    return quantize_pipeline(pipe, out, prompts, ignore, steps, size, seed, pipe.spec.directory, preset)


def quantize_pipeline(
    pipe: Pipeline,
    out: Path,
    prompts: Sequence[str] = DEFAULT_CALIBRATION_PROMPTS,
    ignore: Sequence[str] | None = None,
    steps: int | None = None,
    size: int | None = None,
    seed: int = 0,
    source: Path | None = None,
    preset: str | None = None,
) -> Path:
    """Calibrate a loaded BF16 pipeline and write the FP8 checkpoint; its loaded LoRAs are baked into the
    weights first (so calibration sees the activations they cause); the other components (and the
    checkpoint's generation defaults) are copied from `source` when given, else saved from memory."""
    if not prompts:
        raise InputError("no calibration prompts")
    if pipe.spec.fp8:
        raise InputError(f"{pipe.model_name} is already an FP8 checkpoint: quantize its BF16 source")
    recipe = pipe.model.quantization
    ignore = recipe.bf16_fallback if ignore is None else tuple(ignore)
    run_preset = get_preset(preset, pipe.spec.family.name)
    steps = steps or (
        run_preset.num_inference_steps if run_preset else min(pipe.defaults.num_inference_steps, 20)
    )
    size = size or min(pipe.defaults.width, pipe.defaults.height)
    if pipe.loras:
        pipe.lora.bake()
        pipe.set_variant(pipe.variant)
    linears = quantizable_linears(pipe.transformer, ignore)
    amax = share_group_amax(
        calibrate(pipe, linears, prompts, steps, size, seed, preset), recipe.shared_inputs
    )
    state = fp8_state_dict(pipe.transformer, linears, amax)
    if source is None:
        pipe.model.save(out, skip=("transformer",), defaults=pipe.defaults)
    else:
        shutil.copytree(source, out, ignore=shutil.ignore_patterns("transformer"), dirs_exist_ok=True)
    write_fp8_transformer(pipe.transformer, state, ignore, out / "transformer")
    return out
