"""A human-readable description of a loaded pipeline for `qwen-image info`."""

from collections import Counter

import torch

from models.embedded import EMBEDDED_NAME, training_record
from models.errors import InputError
from models.fp8 import Fp8Linear
from pipelines.parallel import attention_heads, plan_for
from pipelines.qwen_image import QwenImagePipeline


def _params(module: torch.nn.Module) -> str:
    by_dtype: Counter[str] = Counter()
    for p in module.parameters():
        by_dtype[str(p.dtype).removeprefix("torch.")] += p.numel()
    dtypes = ", ".join(f"{name} {n / 1e6:.2f}M" for name, n in by_dtype.most_common())
    return f"{sum(by_dtype.values()) / 1e6:,.2f}M parameters ({dtypes})"


def _quantization(pipe: QwenImagePipeline) -> str:
    quant = pipe.transformer.quant_config
    if quant is None:
        return "none (BF16 weights)"
    fp8 = sum(isinstance(m, Fp8Linear) for m in pipe.transformer.modules())
    kept = ", ".join(quant.ignore) or "nothing"
    return f"ModelOpt {quant.quant_algo}, {fp8} FP8 linears (static per-tensor scales); kept BF16: {kept}"


def _training(pipe: QwenImagePipeline) -> list[str]:
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


def describe(pipe: QwenImagePipeline) -> str:
    """Components, parameter counts by dtype, transformer config, variants and FP8 fusion state."""
    c = pipe.components
    cfg = pipe.transformer.config
    lines = [
        f"model: {pipe.model_name}",
        *_training(pipe),
        f"device: {pipe.device}, dtype: {str(pipe.dtype).removeprefix('torch.')}, variant: {pipe.variant}",
        f"variants available: {', '.join(pipe.available_variants())}",
        f"transformer: {_params(c.transformer)}; {cfg.num_layers} layers, width {cfg.inner_dim}, "
        f"{cfg.num_attention_heads} heads x {cfg.attention_head_dim}, text dim {cfg.joint_attention_dim}",
        f"text encoder: {type(c.text_encoder).__name__}, {_params(c.text_encoder)}",
        f"vae: {type(c.vae).__name__}, {_params(c.vae)}; {c.latent_channels} latent channels, "
        f"{c.vae_scale_factor}x scale (sizes in multiples of {pipe.size_multiple})",
        f"tokenizer: {type(c.tokenizer).__name__}, vocabulary {len(c.tokenizer)}",
        f"scheduler: {type(c.scheduler).__name__}",
        f"defaults: {pipe.defaults.width}x{pipe.defaults.height}, {pipe.defaults.num_inference_steps} steps",
        f"quantization: {_quantization(pipe)}",
        pipe.fusion_summary(),
        f"parallel: {pipe.parallel_summary()}",
    ]
    return "\n".join(lines)


def describe_plans(gpus: int, model: str | None) -> str:
    """The parallel plans `--gpus N` runs with true CFG on and off, or why one does not fit."""
    heads = attention_heads(model)
    lines = []
    for true_cfg in (True, False):
        try:
            plan = plan_for(gpus, heads, true_cfg).describe()
        except InputError as err:
            plan = f"none ({err})"
        lines.append(f"--gpus {gpus} with true CFG {'on' if true_cfg else 'off'}: {plan}")
    return "\n".join(lines)
