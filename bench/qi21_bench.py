"""Qwen-Image 2.1 on one GPU (issue #23 §6): ours vs diffusers on a full-size random 2.1 pipeline in memory.

The pipeline: our 2.1 transformer at the released size (32 layers, width 4096, SwiGLU 12288) with random BF16
weights, a Qwen3-VL-8B-sized text encoder (random), the full 16x VAE (random), Qwen3-VL's image processor with
the real tokenizer. diffusers' `QwenImage21Transformer2DModel` shares our BF16 tensors; ours is calibrated
through the shared quantize code (one prompt, 4 steps at 512x512) into ModelOpt FP8 twice: with the family's
default BF16 fallback (`img_mlp.out` in BF16) and with every block linear in FP8. In one run:

- 1024x1024 text to image, 40 steps (the model's default), true CFG off: ms per step (the first, prefill, step
  apart) and seconds per image, ours fp8-fused + CUDA graphs + KV cache vs diffusers BF16 (its KV cache on);
- the same with an 8-step Turbo grid (`sample_sigmas` for ours, `sigmas=` for diffusers);
- editing with one 1024x1024 condition image: the cached target step vs the uncached full step, ours (graphs
  on) and diffusers;
- peak GPU memory of each run, less the weights of the other pipelines resident for the comparison.

Each configuration runs once to warm up (Triton compiles, CUDA graphs are captured), once with a synchronised
timestamp after every step (ms per step), once plain (seconds per image). Targets (issue #23): >= 2x
diffusers per image; 40 steps <= 2.8 s; Turbo-8 <= 0.7 s; cached step >= 1.8x the uncached one.

    python bench/qi21_bench.py --out DIR [--layers 32] [--steps 40] [--edit-steps 10] [--profile]

`--profile`: only ours (fp8) at --steps and Turbo-8, by phase and kernel kind (bench/request_profile.py).

Prints a table and writes DIR/qi21_bench.json.
"""

import argparse
import copy
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
from request_profile import markdown, profile_request
from transformers import Qwen3VLForConditionalGeneration

from qwen_image_fusion.models.calibration import fp8_state_dict, quantizable_linears, share_group_amax
from qwen_image_fusion.models.family import GenerationDefaults
from qwen_image_fusion.models.loading import transformer_from_state
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.qwen_image.components import default_scheduler
from qwen_image_fusion.models.qwen_image21 import synthetic
from qwen_image_fusion.models.qwen_image21.components import Components21
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image21.family import FAMILY
from qwen_image_fusion.models.qwen_image21.model import QwenImage21Model
from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION
from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.quantize import calibrate
from qwen_image_fusion.pipelines.requests import as_requests

CUDA = torch.device("cuda")
PROMPT = "a capybara wearing a wizard hat, reading a book by candlelight, oil painting"
EDIT_PROMPT = "turn the scene into a snowy winter evening"
SIZE = 1024
TURBO_SIGMAS = tuple(
    float(s) for s in np.linspace(1.0, 1 / 8, 8)
)  # an 8-step grid (the release's is not here)
TARGETS = {"speedup_per_image": 2.0, "t2i_40_s": 2.8, "turbo_8_s": 0.7, "cached_step_speedup": 1.8}
GIB = 1024**3


def build(layers: int) -> tuple[Components21, QwenImage21Transformer2DModel]:
    """Random full-size components on the GPU in BF16, and diffusers' transformer sharing our weights."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    config = QwenImage21Config(num_layers=layers)
    text = synthetic.text_encoder_config(synthetic.QWEN3_VL_8B_TEXT, synthetic.QWEN3_VL_8B_VISION)
    with torch.device(CUDA):
        transformer = QwenImage21Transformer(config).eval().requires_grad_(False)
        text_encoder = Qwen3VLForConditionalGeneration(text).eval().requires_grad_(False)
        vae = AutoencoderKLQwenImage21().eval().requires_grad_(False)
        theirs = QwenImage21Transformer2DModel(**_diffusers_config(config)).eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    theirs.load_state_dict(transformer.state_dict(), strict=True, assign=True)  # one copy of the weights
    transformer.post_load_weights()
    components = Components21(synthetic.processor(), text_encoder, transformer, vae, default_scheduler())
    return components, theirs


def _diffusers_config(config: QwenImage21Config) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_")}


def quantized(components: Components21, prompts: list[str]) -> dict[str, QwenImage21Transformer]:
    """FP8 transformers from one calibration: the default BF16 fallback and every block linear."""
    model = QwenImage21Model(components, CUDA, torch.bfloat16)
    pipe = Pipeline.from_model(model, FAMILY.spec_for(model, "calibration", GenerationDefaults()), "contract")
    linears = quantizable_linears(components.transformer, QUANTIZATION.all_blocks_fp8)
    requests = as_requests(prompts)
    amax = share_group_amax(calibrate(pipe, linears, requests, 4, SIZE // 2, 0), QUANTIZATION.shared_inputs)
    out = {}
    for name, ignore in (
        ("fp8", QUANTIZATION.bf16_fallback),
        ("fp8-all-blocks", QUANTIZATION.all_blocks_fp8),
    ):
        chosen = quantizable_linears(components.transformer, ignore)
        state = fp8_state_dict(components.transformer, chosen, {k: amax[k] for k in chosen})
        with torch.device("meta"):
            meta = QwenImage21Transformer(components.transformer.config)
        quant = QuantConfig("FP8", tuple(ignore))
        out[name] = transformer_from_state(meta, state, quant, torch.bfloat16, Path(f"random-2.1-{name}"))
    return out


def our_pipeline(components: Components21, transformer: QwenImage21Transformer, name: str) -> Pipeline:
    model = QwenImage21Model(replace(components, transformer=transformer), CUDA, torch.bfloat16)
    model.resolution = SIZE  # the condition area (diffusers' output_resolution)
    return Pipeline.from_model(model, FAMILY.spec_for(model, name, GenerationDefaults()), "fp8-fused")


def timed(run: Callable[[Callable[[], None] | None], Any]) -> dict[str, Any]:
    """Warm-up, then a run with a synchronised timestamp after every step, then a plain run."""
    run(None)
    stamps: list[float] = []

    def step() -> None:
        torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    torch.cuda.synchronize()
    stamps.append(time.perf_counter())
    run(step)
    steps_ms = [1000 * (b - a) for a, b in itertools.pairwise(stamps)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = run(None)
    torch.cuda.synchronize()
    return {
        "seconds_per_image": time.perf_counter() - start,
        "first_step_ms": steps_ms[0],  # prefill (with the cache) or the first full step; includes encoding
        "step_ms": statistics.mean(steps_ms[1:]),
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "result": result,
    }


def ours(pipe: Pipeline, steps: int, image: PIL.Image.Image | None = None, cache: bool = True):
    def run(step: Callable[[], None] | None) -> dict[str, float]:
        pipe.model.use_kv_cache = cache
        on_step = None if step is None else (lambda i, n: step())
        size = {} if image is not None else {"width": SIZE, "height": SIZE}
        pipe.generate(
            EDIT_PROMPT if image else PROMPT,
            image=image,
            num_inference_steps=steps,
            seed=1,
            on_step=on_step,
            **size,
        )
        return pipe.last_run.timings

    return run


def theirs(pipe: QwenImage21Pipeline, steps: int, sigmas=None, image=None, cache: bool = True):
    def run(step: Callable[[], None] | None) -> None:
        def callback(_pipe, _i, _t, _kwargs) -> dict:
            step()
            return {}

        size = {} if image is not None else {"width": SIZE, "height": SIZE}
        pipe(
            EDIT_PROMPT if image else PROMPT,
            image=image,
            num_inference_steps=steps,
            sigmas=None if sigmas is None else list(sigmas),
            generator=torch.Generator("cpu").manual_seed(1),
            use_kv_cache=cache,
            output_resolution=SIZE,
            callback_on_step_end=None if step is None else callback,
            **size,
        )

    return run


def weights_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if t.device.type == "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--edit-steps", type=int, default=10)
    parser.add_argument(
        "--profile", action="store_true", help="only profile ours (fp8) at 40 steps and Turbo-8, by phase"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    components, their_transformer = build(args.layers)
    fp8 = quantized(components, [PROMPT])
    components.transformer = None  # the BF16 tensors stay as diffusers' transformer
    print(f"built and calibrated in {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    pipes = {name: our_pipeline(components, model, name) for name, model in fp8.items()}
    if args.profile:
        pipe, size = pipes["fp8"], {"width": SIZE, "height": SIZE, "seed": 1}
        for_steps = profile_request(
            pipe, f"qi21-{args.steps}-steps_{SIZE}", args.out, num_inference_steps=args.steps, **size
        )
        pipe.model.components.sample_sigmas = TURBO_SIGMAS
        turbo = profile_request(pipe, f"qi21-turbo-8_{SIZE}", args.out, num_inference_steps=8, **size)
        print(markdown(for_steps), markdown(turbo), sep="\n\n")
        return
    reference = QwenImage21Pipeline(
        scheduler=copy.deepcopy(components.scheduler),
        vae=components.vae,
        text_encoder=components.text_encoder,
        processor=components.processor,
        transformer=their_transformer,
    )
    reference.set_progress_bar_config(disable=True)
    foreign = {  # weights resident for the comparison that a run does not use
        "diffusers": sum(weights_bytes(m) for m in fp8.values()),
        **{
            name: weights_bytes(their_transformer)
            + sum(weights_bytes(m) for n, m in fp8.items() if n != name)
            for name in fp8
        },
    }
    condition = PIL.Image.fromarray(
        np.random.default_rng(0).integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8)
    )
    runs: dict[str, dict[str, Any]] = {}

    def record(key: str, owner: str, run) -> None:
        result = timed(run)
        result["peak_gib"] = (result.pop("peak_bytes") - foreign[owner]) / GIB
        runs[key] = result
        timings = result.pop("result")
        if timings:
            result["stages_s"] = timings
        line = f"{key}: {result['seconds_per_image']:.3f} s/image, {result['step_ms']:.1f} ms/step"
        print(
            f"{line} (first {result['first_step_ms']:.1f}), peak {result['peak_gib']:.1f} GiB",
            file=sys.stderr,
        )

    record("diffusers t2i", "diffusers", theirs(reference, args.steps))
    record("diffusers turbo-8", "diffusers", theirs(reference, 8, sigmas=TURBO_SIGMAS))
    for name, pipe in pipes.items():
        record(f"{name} t2i", name, ours(pipe, args.steps))
        pipe.model.components.sample_sigmas = TURBO_SIGMAS
        record(f"{name} turbo-8", name, ours(pipe, 8))
        pipe.model.components.sample_sigmas = None
    for name in ("fp8", "fp8-all-blocks"):
        for cache in (True, False):
            record(
                f"{name} edit cache {'on' if cache else 'off'}",
                name,
                ours(pipes[name], args.edit_steps, condition, cache),
            )
    for cache in (True, False):
        record(f"diffusers edit cache {'on' if cache else 'off'}", "diffusers",
               theirs(reference, args.edit_steps, image=condition, cache=cache))  # fmt: skip

    best = min(("fp8", "fp8-all-blocks"), key=lambda n: runs[f"{n} t2i"]["seconds_per_image"])
    verdict = {
        "best_variant": best,
        "speedup_per_image": runs["diffusers t2i"]["seconds_per_image"]
        / runs[f"{best} t2i"]["seconds_per_image"],
        "speedup_per_image_turbo": runs["diffusers turbo-8"]["seconds_per_image"]
        / runs[f"{best} turbo-8"]["seconds_per_image"],
        "t2i_40_s": runs[f"{best} t2i"]["seconds_per_image"],
        "turbo_8_s": runs[f"{best} turbo-8"]["seconds_per_image"],
        "cached_step_speedup": runs[f"{best} edit cache off"]["step_ms"]
        / runs[f"{best} edit cache on"]["step_ms"],
    }
    met = {
        "speedup_per_image": verdict["speedup_per_image"] >= TARGETS["speedup_per_image"],
        "t2i_40_s": verdict["t2i_40_s"] <= TARGETS["t2i_40_s"],
        "turbo_8_s": verdict["turbo_8_s"] <= TARGETS["turbo_8_s"],
        "cached_step_speedup": verdict["cached_step_speedup"] >= TARGETS["cached_step_speedup"],
    }
    report = {
        "gpu": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "diffusers": _version("diffusers"),
            "triton": _version("triton"),
        },
        "config": {
            "layers": args.layers,
            "size": SIZE,
            "steps": args.steps,
            "edit_steps": args.edit_steps,
            "turbo_sigmas": TURBO_SIGMAS,
            "prompt": PROMPT,
        },
        "fusion": {name: pipe.fusion_summary().splitlines()[:2] for name, pipe in pipes.items()},
        "runs": runs,
        "verdict": verdict,
        "targets": TARGETS,
        "met": met,
        "seconds": time.time() - start,
    }
    (args.out / "qi21_bench.json").write_text(json.dumps(report, indent=2))
    print(table(runs))
    print(json.dumps({"verdict": verdict, "met": met}, indent=2))


def table(runs: dict[str, dict[str, Any]]) -> str:
    lines = ["| run | s/image | ms/step | first step ms | peak GiB |", "|---|---|---|---|---|"]
    for key, r in runs.items():
        lines.append(
            f"| {key} | {r['seconds_per_image']:.3f} | {r['step_ms']:.1f} | {r['first_step_ms']:.1f} | "
            f"{r['peak_gib']:.1f} |"
        )
    return "\n".join(lines)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
