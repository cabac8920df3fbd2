"""A human-readable description of a loaded pipeline for `qwen-image info`."""

from qwen_image_fusion.models.embedded import EMBEDDED_NAME, training_record
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import CheckpointSpec
from qwen_image_fusion.models.fp8 import Fp8Linear
from qwen_image_fusion.models.fp8_weight_only import Fp8WeightOnlyLinear
from qwen_image_fusion.models.nvfp4 import Nvfp4Linear
from qwen_image_fusion.pipelines.parallel import check_supported, plan_for
from qwen_image_fusion.pipelines.pipeline import Pipeline


def _quantization(pipe: Pipeline) -> str:
    quant = pipe.transformer.quant_config
    if quant is None:
        return "none (BF16 weights)"
    modules = list(pipe.transformer.modules())
    fp8 = sum(isinstance(m, Fp8Linear) for m in modules)
    weight_only = sum(isinstance(m, Fp8WeightOnlyLinear) for m in modules)
    nvfp4 = sum(isinstance(m, Nvfp4Linear) for m in modules)
    kept = ", ".join(quant.ignore) or "nothing"
    also = f", {weight_only} FP8 weight-only (per-channel scales)" if weight_only else ""
    linears = f"{fp8} FP8 linears (static per-tensor scales){also}"
    if nvfp4:
        linears = f"{nvfp4} NVFP4 linears (E2M1 weights, an E4M3 scale per 16 inputs, global scales)"
    return f"ModelOpt {quant.quant_algo}, {linears}; kept BF16: {kept}"


def _training(pipe: Pipeline) -> list[str]:
    """How the embedded default was trained and what it draws (nothing for other checkpoints)."""
    if pipe.model_name != EMBEDDED_NAME:
        return []
    record = training_record()
    dit, vae = record["dit_run"], record["vae_run"]
    scores = dit["dit"]["held_out_samples"]
    held_out = ", ".join(
        f"{lang} colour+position {s['colour_position']:.0%}, count {s['count']:.0%}, shape {s['shape']:.0%}"
        for lang, s in scores.items()
    )
    return [
        f"trained: on drawn scenes (eval/scenes.py) by training/train_default.py, seed {dit['seed']}, "
        f"{dit['environment']['device']}: VAE {vae['vae']['steps']} steps x {vae['sizes']['vae_batch']}, "
        f"DiT {dit['dit']['steps']} steps x {dit['sizes']['dit_batch']} on {dit['scenes']} scenes "
        f"(training/README.md)",
        f"draws: coloured shapes at named positions, English and Chinese captions; held-out "
        f"{scores['en']['images']} scenes: {held_out}",
    ]


def _input_images(spec: CheckpointSpec) -> str:
    if spec.max_images == 0:
        return "none (text to image)"
    need = "at least 1" if spec.images_required else "optional"
    return f"{need}, at most {spec.max_images} (generate --image FILE, repeatable)"


def describe(pipe: Pipeline) -> str:
    """Family, components, parameter counts by dtype, precision, variants, defaults and FP8 fusion state."""
    d = pipe.defaults
    cfg = (
        f"true CFG {d.true_cfg_scale:g} with negative prompt {d.negative_prompt!r}"
        if d.negative_prompt
        else ("true CFG off unless a negative prompt is given")
    )
    lines = [
        f"model: {pipe.model_name} ({pipe.spec.family.name} family)",
        *_training(pipe),
        f"device: {pipe.device}, dtype: {pipe.precision.describe()}, variant: {pipe.variant}",
        f"variants available: {', '.join(pipe.available_variants())}",
        *pipe.model.describe(),
        f"image sizes: multiples of {pipe.size_multiple}",
        f"input images: {_input_images(pipe.spec)}",
        f"defaults: {d.width}x{d.height}, {d.num_inference_steps} steps, {cfg}",
        f"quantization: {_quantization(pipe)}",
        pipe.fusion_summary(),
        f"parallel: {pipe.parallel_summary()}",
        *([] if pipe.memory is None else pipe.memory.describe()),
    ]
    return "\n".join(lines)


def describe_plans(gpus: int, spec: CheckpointSpec) -> str:
    """The parallel plans `--gpus N` runs with true CFG on and off, or why one does not fit."""
    heads = spec.attention_heads
    lines = []
    for true_cfg in (True, False):
        try:
            chosen = plan_for(gpus, heads, true_cfg)
            check_supported(chosen, spec)
            plan = chosen.describe()
        except InputError as err:
            plan = f"none ({err})"
        lines.append(f"--gpus {gpus} with true CFG {'on' if true_cfg else 'off'}: {plan}")
    return "\n".join(lines)
