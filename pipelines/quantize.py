"""`qwen-image quantize`: static per-tensor FP8 calibration through the denoise loop, ModelOpt export.

Input amax is recorded on every linear to be quantized while real prompts are denoised (with true
CFG, so both branches are seen); weights get per-tensor amax scales; the Q/K/V (and add_q/k/v) of a
stream share one input scale. The result is a diffusers-layout checkpoint whose `transformer/` is a
ModelOpt FP8 export (DESIGN §3) that this project and other ModelOpt consumers load.
"""

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from kernels.quant import FP8_MAX
from models.components import save_components
from models.errors import InputError
from models.fp8 import MIN_AMAX, quantize_weight
from models.loading import save_tensors
from models.lora import LoraFile
from models.modelopt import QuantConfig
from models.transformer import QwenImageTransformer
from pipelines.lora import bake_into_weights
from pipelines.presets import get_preset
from pipelines.qwen_image import QwenImagePipeline, load_pipeline

DEFAULT_BF16_FALLBACK = (
    "img_in",
    "txt_in",
    "time_text_embed.*",
    "norm_out.linear",
    "proj_out",
    "*.img_mod.1",
    "*.txt_mod.1",
    "*.img_mlp.net.2",
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
ALL_BLOCKS_FP8 = tuple(p for p in DEFAULT_BF16_FALLBACK if p != "*.img_mlp.net.2")
SHARED_INPUT_GROUPS = (("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj"))
PRODUCER = {"name": "qwen-image-fusion", "version": "0.1.0"}


def quantizable_linears(model: QwenImageTransformer, ignore: Sequence[str]) -> dict[str, nn.Linear]:
    """The Linears that become FP8: every one not matched by an ignore glob."""
    config = QuantConfig("FP8", tuple(ignore))
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not config.ignores(n)}


def calibrate(
    pipe: QwenImagePipeline,
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
                )
    finally:
        pipe.cuda_graphs = graphs
    return amax


@contextmanager
def record_input_amax(linears: dict[str, nn.Linear]) -> Iterator[dict[str, torch.Tensor]]:
    """While active, the running max |input| of each linear (device scalars, no host syncs).

    On exit the hooks are removed, and a linear that never ran is an error.
    """
    amax: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            current = args[0].detach().abs().amax().float()
            amax[name] = current if name not in amax else torch.maximum(amax[name], current)

        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    try:
        yield amax
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(set(linears) - set(amax))
    if missing:
        raise RuntimeError(f"calibration never reached {missing[:3]}")


def share_group_amax(amax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One input amax for the linears that read the same activation (Q/K/V of each stream)."""
    shared = dict(amax)
    for name in amax:
        prefix, _, leaf = name.rpartition(".")
        for group in SHARED_INPUT_GROUPS:
            members = [f"{prefix}.{m}" for m in group]
            if leaf in group and all(m in amax for m in members):
                shared[name] = torch.stack([amax[m] for m in members]).max()
    return shared


def fp8_state_dict(
    model: QwenImageTransformer, linears: dict[str, nn.Linear], input_amax: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The ModelOpt FP8 state dict (on the model's device): e4m3 weights, fp32 scalar scales, BF16 biases."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    for name, linear in linears.items():
        state[f"{name}.weight"], state[f"{name}.weight_scale"] = quantize_weight(linear.weight.detach())
        state[f"{name}.input_scale"] = (input_amax[name].clamp_min(MIN_AMAX) / FP8_MAX).reshape(())
    return state


def write_fp8_transformer(
    model: QwenImageTransformer, state: dict[str, torch.Tensor], ignore: Sequence[str], directory: Path
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
    ignore: Sequence[str] = DEFAULT_BF16_FALLBACK,
    steps: int | None = None,
    size: int | None = None,
    device: str | None = None,
    seed: int = 0,
    loras: Sequence[tuple[str | Path | LoraFile, float]] = (),
    preset: str | None = None,
) -> Path:
    """Calibrate `model` (None: the embedded default) and write its FP8 ModelOpt checkpoint to `out`;
    `loras` (file, scale) are baked into the BF16 weights first, `preset` sets the calibration run."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"output {out} exists and is not an empty directory")
    get_preset(preset)
    pipe = load_pipeline(model, variant="contract", device=device)
    for lora_file, scale in loras:
        pipe.load_lora(lora_file, scale)
    source = None if model is None else Path(model)
    return quantize_pipeline(pipe, out, prompts, ignore, steps, size, seed, source, preset)


def quantize_pipeline(
    pipe: QwenImagePipeline,
    out: Path,
    prompts: Sequence[str] = DEFAULT_CALIBRATION_PROMPTS,
    ignore: Sequence[str] = DEFAULT_BF16_FALLBACK,
    steps: int | None = None,
    size: int | None = None,
    seed: int = 0,
    source: Path | None = None,
    preset: str | None = None,
) -> Path:
    """Calibrate a loaded BF16 pipeline and write the FP8 checkpoint; its loaded LoRAs are baked into the
    weights first (so calibration sees the activations they cause); other components are copied from
    `source` when given, else saved from memory."""
    if not prompts:
        raise InputError("no calibration prompts")
    if pipe.transformer.is_fp8:
        raise InputError(f"{pipe.model_name} is already an FP8 checkpoint")
    run_preset = get_preset(preset)
    steps = steps or (
        run_preset.num_inference_steps if run_preset else min(pipe.defaults.num_inference_steps, 20)
    )
    size = size or min(pipe.defaults.width, pipe.defaults.height)
    if pipe.loras:
        bake_into_weights(pipe)
    linears = quantizable_linears(pipe.transformer, ignore)
    amax = share_group_amax(calibrate(pipe, linears, prompts, steps, size, seed, preset))
    state = fp8_state_dict(pipe.transformer, linears, amax)
    if source is None:
        save_components(pipe.components, out, skip=("transformer",))
    else:
        shutil.copytree(source, out, ignore=shutil.ignore_patterns("transformer"), dirs_exist_ok=True)
    write_fp8_transformer(pipe.transformer, state, ignore, out / "transformer")
    return out
