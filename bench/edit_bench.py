"""Editing on one GPU (issue 22 §6): an FP8 Edit-2511 checkpoint, 1024x1024 output with one 1024x1024
reference image, true CFG (negative " ", scale 4). In one run:

- ms per denoising step, ours (fp8-fused, CUDA graphs) against diffusers' `QwenImageEditPlusPipeline` in BF16
  with diffusers' transformer on the same weights (the FP8 ones dequantized; eager, as diffusers runs),
  both timed the same way: CUDA-synchronized timestamps after every step, the median gap; ours before and
  after diffusers (the clock drifts under load);
- seconds per image end to end at 40 steps with true CFG;
- seconds per image with the edit-lightning-4 preset and a random LoRA of the Edit Lightning release's shape
  (rank 64, alpha 8, the 12 attention and MLP linears of every block), merged into the FP8 weights.

Writes JSON with the targets: <= 500 ms/step with CFG, >= 1.7x diffusers per step, Lightning-4 <= 1.1 s.

    python bench/make_random_checkpoint.py --edit --out /tmp/qwen-image-edit-random-fp8     # once
    python bench/edit_bench.py --model /tmp/qwen-image-edit-random-fp8 --out edit_bench.json  # H200

On a CPU (a smoke run of the script) give a small FP8 Edit checkpoint and small --size / --steps.
"""

import argparse
import copy
import inspect
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lora_bench import timed, write_random_lora
from PIL import Image

from qwen_image_fusion.models.fp8 import Fp8Linear
from qwen_image_fusion.models.modelopt import SCALE_SUFFIXES
from qwen_image_fusion.models.qwen_image_edit.conditioning import load_edit_image
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.requests import builtin_edit_set

PROMPT = "a red fox in the snow, detailed fur, golden hour"  # lora_bench.timed's prompt: the instruction
RELEASE_LINEARS = (  # what the Edit-2509/2511 Lightning files target in every block (720 layers in 60)
    *("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    *("attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj"),
    "txt_mlp.net.2",
)
TARGETS = {"ms_per_step": (500.0, "<="), "speedup_vs_diffusers": (1.7, ">="), "lightning4_s": (1.1, "<=")}


def reference_image(size: int) -> Image.Image:
    """A drawn scene of the built-in edit set, resized to `size` x `size`."""
    return Image.open(builtin_edit_set("edit")[0].images[0]).convert("RGB").resize((size, size))


def step_gaps(run: Callable[[Callable[[], None]], None]) -> list[float]:
    """Milliseconds between CUDA-synchronized timestamps taken after each denoising step of `run(tick)`."""
    stamps: list[float] = []

    def tick() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    run(tick)
    return [1000 * (b - a) for a, b in itertools.pairwise(stamps)]


def ours_per_step(pipe: Pipeline, steps: int, **kwargs) -> list[float]:
    """Our step gaps after a warm-up with the same shapes (graph capture, autotuning)."""
    pipe.generate(PROMPT, num_inference_steps=2, seed=0, **kwargs)
    return step_gaps(lambda tick: pipe.generate(PROMPT, num_inference_steps=steps, seed=1,
                                                on_step=lambda i, n: tick(), **kwargs))  # fmt: skip


def diffusers_transformer(pipe: Pipeline):
    """diffusers' own transformer in BF16 holding our weights (FP8 linears dequantized), eager, as diffusers
    runs it."""
    from diffusers import QwenImageTransformer2DModel

    return diffusers_copy(pipe.transformer, QwenImageTransformer2DModel)


def diffusers_copy(ours: torch.nn.Module, cls: type):
    """diffusers' `cls` in BF16 holding the weights of our module `ours` (FP8 linears dequantized: `weight *
    weight_scale`), with its own RoPE module."""
    accepted = inspect.signature(cls.__init__).parameters
    config = {k: v for k, v in ours.config.to_dict().items() if k in accepted}  # not the FP8 export's
    state = {k: v for k, v in ours.state_dict().items() if not k.endswith(SCALE_SUFFIXES)}
    for name, module in ours.named_modules():
        if isinstance(module, Fp8Linear):
            state[f"{name}.weight"] = module.dequantized_weight().to(torch.bfloat16)
    with torch.device("meta"):
        theirs = cls(**config)
    theirs.load_state_dict(state, assign=True)
    axes = list(ours.config.to_dict()["axes_dims_rope"])
    theirs.pos_embed = type(theirs.pos_embed)(theta=10000, axes_dim=axes, scale_rope=True)
    return theirs.eval()


def diffusers_pipeline(pipe: Pipeline):
    """diffusers' QwenImageEditPlusPipeline around our text encoder, processor and VAE, with its own
    transformer (`diffusers_transformer`)."""
    from diffusers import QwenImageEditPlusPipeline

    c = pipe.components
    diffusers = QwenImageEditPlusPipeline(
        scheduler=copy.deepcopy(c.scheduler), vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
        processor=c.processor, transformer=diffusers_transformer(pipe),
    )  # fmt: skip
    diffusers.set_progress_bar_config(disable=True)
    return diffusers


def diffusers_per_step(pipe: Pipeline, steps: int, image: Image.Image, size: int) -> list[float]:
    """diffusers' step gaps after a warm-up run (kernel choices, allocator), same request as ours."""
    theirs = diffusers_pipeline(pipe)
    call = dict(image=[load_edit_image(image)], prompt=PROMPT, negative_prompt=" ", true_cfg_scale=4.0,
                width=size, height=size, num_inference_steps=steps, output_type="latent")  # fmt: skip

    def run(tick: Callable[[], None]) -> None:
        def on_step(_pipe, _i, _t, _kwargs) -> dict:
            tick()
            return {}

        with torch.no_grad():
            theirs(**call, generator=torch.Generator("cpu").manual_seed(1), callback_on_step_end=on_step)

    run(lambda: None)
    return step_gaps(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", required=True, help="FP8 Edit-2511 checkpoint (make_random_checkpoint --edit)"
    )
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="steps of each per-step timing run")
    parser.add_argument("--full-steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    pipe = load_pipeline(args.model, dtype="bf16")  # every component in BF16, as diffusers shares them
    image = reference_image(args.size)
    edit = dict(image=[image], width=args.size, height=args.size)
    cfg = edit | dict(negative_prompt=" ", true_cfg_scale=4.0)
    device = torch.cuda.get_device_name() if pipe.device.type == "cuda" else "cpu"
    result: dict = {"model": args.model, "device": device, "size": args.size}
    result |= {
        "variant": pipe.variant,
        "fusion": pipe.fusion_summary().splitlines()[0],
        "load_s": time.perf_counter() - start,
    }
    print(f"loaded in {result['load_s']:.0f} s: {result['fusion']}", flush=True)

    ours_before = ours_per_step(pipe, args.steps, **cfg)
    result["tokens"] = {
        "image": 2 * (args.size // 16) ** 2,
        "text": int(pipe.encode([PROMPT], 512, 1, [image]).embeds.shape[1]),
    }
    theirs = diffusers_per_step(pipe, args.steps, image, args.size)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # diffusers' BF16 transformer is gone: its 41 GB go back
    ours_after = ours_per_step(pipe, args.steps, **cfg)
    ours_ms, theirs_ms = statistics.median(ours_before + ours_after), statistics.median(theirs)
    result["per_step_ms"] = {"ours_fp8_fused_graph": ours_ms, "diffusers_bf16": theirs_ms,
                             "ours_gaps": ours_before + ours_after, "diffusers_gaps": theirs}  # fmt: skip
    print(
        f"ms/step with CFG: ours {ours_ms:.1f}, diffusers {theirs_ms:.1f} ({theirs_ms / ours_ms:.2f}x)",
        flush=True,
    )

    result["full_cfg"] = timed(pipe, 1, warm_steps=2, num_inference_steps=args.full_steps, **cfg)
    result["full_cfg"]["timings"] = dict(pipe.last_run.timings)
    print(f"{args.full_steps} steps + CFG: {result['full_cfg']['seconds']:.2f} s per image", flush=True)

    work = Path(tempfile.mkdtemp(prefix="edit_bench_"))
    lora = write_random_lora(
        pipe, 64, 8.0, work / "Qwen-Image-Edit-2511-Lightning-random.safetensors", RELEASE_LINEARS
    )
    pipe.load_lora(lora)
    pipe.set_lora_mode("merge")
    result["lora"] = {"layers": pipe.loras[lora.stem].layers, "merge": pipe.lora_merge.summary()}
    result["lightning4"] = timed(pipe, args.runs, preset="edit-lightning-4", negative_prompt=" ", **edit)
    result["lightning4"]["timings"] = dict(pipe.last_run.timings)
    print(f"edit-lightning-4 (merged): {result['lightning4']['seconds']:.3f} s per image", flush=True)

    values = {
        "ms_per_step": ours_ms,
        "speedup_vs_diffusers": theirs_ms / ours_ms,
        "lightning4_s": result["lightning4"]["seconds"],
    }
    result["targets"] = {
        key: {
            "value": value,
            "target": TARGETS[key][0],
            "met": value <= TARGETS[key][0] if TARGETS[key][1] == "<=" else value >= TARGETS[key][0],
        }
        for key, value in values.items()
    }
    result["total_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for key, target in result["targets"].items():
        verdict = "met" if target["met"] else "MISSED"
        print(f"{key}: {target['value']:.3f} (target {TARGETS[key][1]} {target['target']}) {verdict}")
    print(f"wrote {args.out} in {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
