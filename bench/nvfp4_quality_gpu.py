"""NVFP4's quality on the full-size random Qwen-Image model (issue 52 part 4): PSNR and SSIM of NVFP4 images
(the weight path) against BF16 and against FP8, with quantize's default BF16 rules and in every block.

Random weights make meaningless pictures: the numbers measure how far the 4-bit weights move this network's
output (same prompts, seeds, latents and text embeddings; only the DiT's weights differ), not the trained
model's picture quality (BENCHMARKS.md's CPU rows measure that on the trained embedded default).

One process, nothing on disk. The checkpoint route (`make_random_checkpoint.py --bf16`, then
`quantize --format nvfp4 [--keep-bf16 <outside>]` and `eval.parity` per pair) does not fit the device: the
BF16 checkpoint alone is ~57 GB with its text encoder on a 64 GiB disk, so no quantized one fits beside it,
and four parity runs would load ~40 GB checkpoints eight times in one 560 s call. Here the seeded random BF16
components are built once on the device (`make_random_checkpoint.full_size_components`, the weights every
`make_random_checkpoint` build starts from), and each quantized DiT comes from the BF16 one through
`quantize`'s own pieces: its calibration run (`calibrate`: the denoise loop with true CFG, as
make_random_checkpoint calibrates: one prompt, 4 steps at 512), its rules (`kept_bf16`: FP8's fallback list,
NVFP4's first and last two blocks and everything outside the blocks; `nvfp4-every-block` keeps only what is
outside the blocks, i.e. `quantize --format nvfp4 --keep-bf16 <outside_blocks>`), its state dicts
(`fp8_state_dict`, `nvfp4_state_dict`) and the loader's `transformer_from_state`. Each side is a `Pipeline`
on the same tokenizer, text encoder, VAE and scheduler, run as the CPU table's sides run (`contract`,
`fp8-fused`, `nvfp4`), and pairs are measured with eval's metric functions (PSNR, SSIM).

Memory (fits one H100's ~78 GiB): BF16 components ~54 GiB (text encoder 15, DiT 38); each quantized state is
derived on the device before any BF16 image (no CUDA graph pool yet) and parked in host memory (FP8 ~19 GiB,
NVFP4 ~12 and ~11); after the BF16 images the BF16 DiT is dropped and each quantized DiT runs alone beside
the text encoder (peak ~73 GiB while deriving FP8; the report records the peak allocated).

GPU runtime: 154 s on one H100 (session 22, the 5 smoke prompts x 10 steps with CFG for BF16 twice, FP8 and
both NVFP4 builds, peak 63.9 GiB allocated; BENCHMARKS.md).

    python -m bench.nvfp4_quality_gpu --out /tmp/nvfp4_quality.json                  # full size, on cuda
    python -m bench.nvfp4_quality_gpu --tiny --layers 6 --size 64x64 --steps 2 --out q.json  # CPU, seconds

(`bash bench/gpu_suite.sh nvfp4-quality` runs the first; the JSON has each pair, min / p10 / median / p90 /
max of PSNR and SSIM per row, what each build kept in BF16, the commit, the machine and the settings.)
"""

import argparse
import datetime
import gc
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.quality_table import run_text, spread
from qwen_image_fusion.eval.metrics import abs_diff, psnr, ssim
from qwen_image_fusion.eval.prompts import load_requests
from qwen_image_fusion.eval.report import write_json
from qwen_image_fusion.kernels.nvfp4 import NVFP4_BLOCK
from qwen_image_fusion.models.calibration import (
    fp8_state_dict,
    nvfp4_state_dict,
    quantizable_linears,
    share_group_amax,
)
from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.family import GenerationDefaults, parameter_summary
from qwen_image_fusion.models.loading import transformer_from_state
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.qwen_image.components import Components, default_scheduler
from qwen_image_fusion.models.qwen_image.family import FAMILY
from qwen_image_fusion.models.qwen_image.model import QwenImageModel
from qwen_image_fusion.models.qwen_image.text_encoder import tiny_text_encoder_config
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.quantize import calibrate, kept_bf16
from qwen_image_fusion.pipelines.requests import as_requests

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "qwen-image-fusion/nvfp4-quality-random"
NOTE = (
    "Random weights make meaningless pictures: these numbers measure how far each format's weights move the "
    "output of the same random network from the same latents and text embeddings, not picture quality."
)
CALIBRATION_PROMPT = "a red fox in the snow"  # make_random_checkpoint calibrates: this, 4 steps, 512
CALIBRATION_STEPS = 4


@dataclass(frozen=True)
class Build:
    """One DiT: its weight format, the pipeline variant it runs as, and its BF16 rules (None: the format's
    default, as `quantize` without --keep-bf16; "outside": only what stays outside the blocks)."""

    name: str
    weights: WeightFormat
    variant: str
    keep: str | None = None


BF16 = Build("bf16", WeightFormat.BF16, "contract")
BUILDS = (
    BF16,
    Build("fp8", WeightFormat.FP8, "fp8-fused"),
    Build("nvfp4", WeightFormat.NVFP4, "nvfp4"),
    Build("nvfp4-every-block", WeightFormat.NVFP4, "nvfp4", keep="outside"),
)


@dataclass(frozen=True)
class Row:
    """A compared pair of sides; `bf16-again` is the BF16 pipeline run a second time."""

    name: str
    title: str
    candidate: str
    exact: str


ROWS = (
    Row("bf16-repeat", "BF16 again, against BF16 (determinism: expected identical)", "bf16-again", "bf16"),
    Row("fp8", "FP8 (default BF16 fallback list), against BF16", "fp8", "bf16"),
    Row("nvfp4", "NVFP4 weights (default rules: first and last two blocks in BF16)", "nvfp4", "bf16"),
    Row("nvfp4-every-block", "NVFP4 weights in every block", "nvfp4-every-block", "bf16"),
    Row("nvfp4-against-fp8", "NVFP4 (default rules), against FP8", "nvfp4", "fp8"),
    Row("nvfp4-every-block-against-fp8", "NVFP4 in every block, against FP8", "nvfp4-every-block", "fp8"),
)


def log(line: str) -> None:
    print(line, flush=True)


def tiny_components(layers: int, device: torch.device) -> Components:
    """Seeded random components at toy sizes for a CPU run in seconds: DiT width 64 (two 32-wide heads), a
    2-layer 64-wide Qwen2.5-VL text encoder, a 4-channel VAE, the real tokenizer."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLForConditionalGeneration

    from qwen_image_fusion.training.recipe import dit_config, vae_config

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        text_encoder = Qwen2_5_VLForConditionalGeneration(tiny_text_encoder_config(64, 2))
        transformer = QwenImageTransformer(dit_config(64, layers, 64))
        vae = AutoencoderKLQwenImage(**vae_config(4))
    torch.set_default_dtype(torch.float32)
    for module in (text_encoder, transformer, vae):
        module.eval().requires_grad_(False)
    transformer.post_load_weights()
    return Components(build_qwen2_tokenizer(), text_encoder, transformer, vae, default_scheduler())


def pipeline_of(
    components: Components, transformer: torch.nn.Module, variant: str, device: torch.device
) -> Pipeline:
    """A pipeline on the shared tokenizer, text encoder, VAE and scheduler with this DiT."""
    parts = Components(
        components.tokenizer, components.text_encoder, transformer, components.vae, components.scheduler
    )
    model = QwenImageModel(parts, device, torch.bfloat16)
    spec = FAMILY.spec_for(model, "random", GenerationDefaults())
    return Pipeline.from_model(model, spec, variant)


def quantized_state(pipe: Pipeline, build: Build, calibration_size: int) -> tuple[dict, QuantConfig, dict]:
    """`quantize`'s steps for one DiT, in memory: its BF16 rules, calibration through the denoise loop, one
    input scale per shared-input group, the ModelOpt state dict. Returns the state (in host memory), its
    QuantConfig and what it kept."""
    recipe = pipe.model.quantization
    transformer = pipe.transformer
    kept = kept_bf16(recipe, transformer, build.weights, recipe.outside_blocks if build.keep else None)
    linears = quantizable_linears(transformer, kept)
    requests = as_requests([CALIBRATION_PROMPT])
    amax = calibrate(pipe, linears, requests, CALIBRATION_STEPS, calibration_size, seed=0)
    amax = share_group_amax(amax, recipe.shared_inputs)
    if build.weights is WeightFormat.FP8:
        state, quant = fp8_state_dict(transformer, linears, amax), QuantConfig("FP8", kept)
    else:
        state = nvfp4_state_dict(transformer, linears, amax)
        quant = QuantConfig("NVFP4", kept, group_size=NVFP4_BLOCK)
    host = {k: v.to("cpu") for k, v in state.items()}  # the BF16 DiT leaves the device before these load
    blocks = {name.split(".")[1] for name in linears if name.startswith("transformer_blocks.")}
    info = {
        "kept_bf16": list(kept),
        "quantized_linears": len(linears),
        "quantized_blocks": f"{len(blocks)} of {len(transformer.transformer_blocks)}",
    }
    return host, quant, info


def load_quantized(config, state: dict, quant: QuantConfig, device: torch.device) -> QwenImageTransformer:
    with torch.device("meta"):
        meta = QwenImageTransformer(config)
    on_device = {k: v.to(device) for k, v in state.items()}
    return transformer_from_state(meta, on_device, quant, torch.bfloat16, Path("random"))


def free(device: torch.device) -> None:
    """Hand what is no longer referenced back to the device (the caching allocator's blocks too)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def generate_all(pipe: Pipeline, side: str, jobs: list[tuple[str, int]], args) -> list[np.ndarray]:
    """Every (prompt, seed) image of one side, as uint8 RGB arrays; progress per step on stdout."""
    images = []
    for i, (prompt, seed) in enumerate(jobs, 1):
        start = time.perf_counter()

        def on_step(step: int, total: int, i: int = i) -> None:
            log(f"  [{side}] image {i}/{len(jobs)} step {step}/{total}")

        image = pipe.generate(
            prompt,
            negative_prompt=args.negative_prompt,
            width=args.width,
            height=args.height,
            num_inference_steps=args.steps,
            true_cfg_scale=args.cfg,
            seed=seed,
            on_step=on_step,
        )[0]
        images.append(np.asarray(image.convert("RGB"), dtype=np.uint8))
        log(f"[{side}] image {i}/{len(jobs)} in {time.perf_counter() - start:.1f} s")
    return images


def pair_metrics(a: np.ndarray, b: np.ndarray) -> dict:
    diff = abs_diff(a, b)
    return {
        "identical": bool(np.array_equal(a, b)),
        "psnr_db": psnr(a, b),
        "ssim": ssim(a, b),
        "max_abs_diff": int(diff.max()),
        "mean_abs_diff": float(diff.mean()),
    }


def machine(device: torch.device) -> dict:
    import diffusers

    # the device copy's history can be older than its tree: pass COMMIT= (bench/gpu_suite.sh says so too)
    commit = os.environ.get("COMMIT") or "not passed; history head " + run_text(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"]
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": str(device),
        "name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        "commit": commit,
    }


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    started = time.perf_counter()
    prompts = [r.prompt for r in load_requests(args.prompts)][: args.max_prompts]
    jobs = [(prompt, seed) for seed in args.seeds for prompt in prompts]
    log(f"building {'tiny' if args.tiny else 'full-size'} random BF16 components on {device}")
    if args.tiny:
        components = tiny_components(args.layers or 6, device)
    else:
        from bench.make_random_checkpoint import full_size_components

        components = full_size_components(args.layers or 60, device)
    config = components.transformer.config
    log(f"built in {time.perf_counter() - started:.0f} s: {parameter_summary(components.transformer)}")
    images: dict[str, list[np.ndarray]] = {}
    builds: dict[str, dict] = {}
    pipe = pipeline_of(components, components.transformer, BF16.variant, device)
    states = {}
    for build in BUILDS[1:]:  # before any BF16 image: no CUDA graph's memory beside the BF16 DiT yet
        start = time.perf_counter()
        log(f"[{build.name}] calibrating and quantizing ({build.weights.name})")
        states[build.name] = quantized_state(pipe, build, args.calibration_size)
        builds[build.name] = {"quantize_seconds": time.perf_counter() - start, **states[build.name][2]}
        free(device)
    images["bf16"] = generate_all(pipe, "bf16", jobs, args)
    images["bf16-again"] = generate_all(pipe, "bf16-again", jobs, args)
    builds["bf16"] = {"variant": pipe.variant, "parameters": parameter_summary(pipe.transformer)}
    del pipe
    components.transformer = None  # the BF16 DiT leaves the device: each quantized one runs alone
    free(device)
    for build in BUILDS[1:]:
        state, quant, _ = states.pop(build.name)
        transformer = load_quantized(config, state, quant, device)
        del state
        pipe = pipeline_of(components, transformer, build.variant, device)
        builds[build.name] |= {"variant": pipe.variant, "parameters": parameter_summary(transformer)}
        start = time.perf_counter()
        images[build.name] = generate_all(pipe, build.name, jobs, args)
        builds[build.name]["generate_seconds"] = time.perf_counter() - start
        del pipe, transformer
        free(device)
    rows = {}
    for row in ROWS:
        pairs = [
            {"prompt": prompt, "seed": seed, **pair_metrics(images[row.exact][i], images[row.candidate][i])}
            for i, (prompt, seed) in enumerate(jobs)
        ]
        psnr_spread, ssim_spread = (spread([p[metric] for p in pairs]) for metric in ("psnr_db", "ssim"))
        rows[row.name] = {
            "title": row.title,
            "candidate": row.candidate,
            "against": row.exact,
            "identical": sum(p["identical"] for p in pairs),
            "median_psnr_db": psnr_spread["median"],
            "median_ssim": ssim_spread["median"],
            "psnr_db": psnr_spread,
            "ssim": ssim_spread,
            "pairs": pairs,
        }
        log(
            f"{row.name}: PSNR median {rows[row.name]['median_psnr_db']:.2f} dB, "
            f"SSIM median {rows[row.name]['median_ssim']:.4f} ({len(pairs)} pairs)"
        )
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "schema": SCHEMA,
        "schema_version": 1,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": sys.argv,
        "note": NOTE,
        "machine": machine(device),
        "settings": {
            "model": "tiny random" if args.tiny else "full-size random (make_random_checkpoint's weights)",
            "layers": config.num_layers,
            "width": args.width,
            "height": args.height,
            "steps": args.steps,
            "true_cfg_scale": args.cfg,
            "negative_prompt": args.negative_prompt,
            "prompts": args.prompts,
            "prompt_count": len(prompts),
            "seeds": list(args.seeds),
            "calibration": {
                "prompt": CALIBRATION_PROMPT,
                "steps": CALIBRATION_STEPS,
                "size": args.calibration_size,
            },
        },
        "builds": builds,
        "rows": rows,
        "peak_allocated_gib": peak,
        "seconds": time.perf_counter() - started,
    }


def size_arg(text: str) -> tuple[int, int]:
    width, height = (int(v) for v in text.lower().split("x"))
    return width, height


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU tests), not the full-size model")
    parser.add_argument("--layers", type=int, help="transformer blocks (default 60, --tiny 6)")
    parser.add_argument("--size", type=size_arg, default=(1024, 1024), help="WIDTHxHEIGHT (%(default)s)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cfg", type=float, default=4.0, help="true CFG scale (1: off)")
    parser.add_argument("--negative-prompt", default=" ")
    parser.add_argument("--prompts", default="smoke", help="eval prompt set or file (%(default)s)")
    parser.add_argument("--max-prompts", type=int, help="only the first N prompts")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    parser.add_argument("--calibration-size", type=int, help="calibration side (default 512, --tiny 64)")
    parser.add_argument("--device", help="default: cuda if available")
    args = parser.parse_args(argv)
    args.width, args.height = args.size
    args.calibration_size = args.calibration_size or (64 if args.tiny else 512)
    report = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(report, args.out)
    log(f"{NOTE}\nwrote {args.out} in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
