"""LoRA and Lightning on one GPU: seconds per image and per step, base vs Lightning, LoRA branch vs merged.

A random LoRA of rank 64 on every block linear (the 14 per block, as the Lightning release targets them),
written in the Lightning release layout and loaded through the real reader, on an FP8 checkpoint (the
full-size random one of bench/make_random_checkpoint.py; pass --model to reuse it). At --size (1024):
- base: --base-steps (50) steps with true CFG (negative " ", scale 4), no LoRA, end to end;
- per step (no CFG, batch 1, --step-steps each, median of --runs): no LoRA, then LoRA branch and merged
  in a balanced order (branch, merge, merge, branch: the GPU clock drifts under sustained load);
- Lightning-8 and Lightning-4 end to end with the LoRA merged (and Lightning-8 in branch mode);
- how far the LoRA pushes FP8 inputs past their calibrated scales (one eager unfused run).
Every timed configuration is warmed up first (graph capture, autotuning) with the same shapes. Writes
JSON with the issue's targets: Lightning-8 <= 1.1 s, Lightning-4 <= 0.65 s, branch <= 10% slower per
step than merged.

    python bench/lora_bench.py --model /tmp/qwen-image-random-fp8 --out lora_bench.json        # H200
    python bench/lora_bench.py --embedded --size 64 --base-steps 4 --step-steps 4 --rank 8 --out /tmp/lb.json
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from qwen_image_fusion.models.lora import lora_targets
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.lora import fp8_input_clipping
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

PROMPT = "a red fox in the snow, detailed fur, golden hour"
BLOCK_LINEARS = (
    *("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    *("attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj"),
    *("txt_mlp.net.2", "img_mod.1", "txt_mod.1"),
)
TARGETS = {"lightning8_s": 1.1, "lightning4_s": 0.65, "branch_over_merged": 1.10}


def write_random_lora(
    pipe: Pipeline, rank: int, alpha: float, path: Path, linears: tuple[str, ...] = BLOCK_LINEARS
) -> Path:
    """Lightning-layout file (`<module>.lora_down.weight`, `.lora_up.weight`, `.alpha`, bf16): `linears` of
    every block, factors scaled so the LoRA's delta has about a tenth of the spread of a default-
    initialized weight (std 0.58 / sqrt(fan_in), as in bench/make_random_checkpoint.py's model)."""
    gen = torch.Generator(pipe.device).manual_seed(0)
    targets = lora_targets(pipe.transformer)
    tensors = {}
    for i in range(pipe.transformer.config.num_layers):
        for leaf in linears:
            name = f"transformer_blocks.{i}.{leaf}"
            layer = targets[name]
            std = (0.058 / (layer.in_features**0.5 * (alpha / rank) * rank**0.5)) ** 0.5
            down = torch.randn(rank, layer.in_features, generator=gen, device=pipe.device) * std
            up = torch.randn(layer.out_features, rank, generator=gen, device=pipe.device) * std
            tensors[f"{name}.lora_down.weight"] = down.bfloat16().cpu()
            tensors[f"{name}.lora_up.weight"] = up.bfloat16().cpu()
            tensors[f"{name}.alpha"] = torch.tensor(alpha, dtype=torch.bfloat16)
    save_file(tensors, path)
    return path


def timed(pipe: Pipeline, runs: int, warm_steps: int | None = None, **kwargs) -> dict[str, float]:
    """Median seconds end to end and ms per step over `runs` generations after one warm-up with the same
    shapes (`warm_steps` fewer steps when given: graphs depend on shapes only)."""
    warm = kwargs | ({"num_inference_steps": warm_steps} if warm_steps else {})
    pipe.generate(PROMPT, seed=0, **warm)
    totals, steps = [], []
    for i in range(runs):
        pipe.generate(PROMPT, seed=i + 1, **kwargs)
        totals.append(pipe.last_run.timings["total"])
        steps.append(pipe.last_run.ms_per_step)
    return {"seconds": statistics.median(totals), "ms_per_step": statistics.median(steps), "runs": totals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="FP8 checkpoint directory (bench/make_random_checkpoint.py writes one)"
    )
    parser.add_argument(
        "--embedded", action="store_true", help="quantize the embedded model instead (CPU smoke)"
    )
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--base-steps", type=int, default=50)
    parser.add_argument("--step-steps", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=8.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if (args.model is None) == (not args.embedded):
        parser.error("give --model DIR or --embedded")
    work = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    start = time.perf_counter()
    model = args.model
    if args.embedded:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = quantize_checkpoint(
            None, work / "fp8", prompts=["a red fox"], steps=2, size=64, device=device
        )
    pipe = load_pipeline(model)
    loaded = time.perf_counter() - start
    size = dict(width=args.size, height=args.size)
    no_cfg = size | dict(num_inference_steps=args.step_steps, negative_prompt=" ", true_cfg_scale=1.0)
    result: dict = {
        "model": str(model),
        "device": torch.cuda.get_device_name() if pipe.device.type == "cuda" else "cpu",
    }
    result |= {"size": args.size, "rank": args.rank, "alpha": args.alpha, "load_s": loaded}

    base_args = size | dict(num_inference_steps=args.base_steps, negative_prompt=" ", true_cfg_scale=4.0)
    result["base_cfg"] = timed(pipe, 1, warm_steps=2, **base_args)
    step = {"none": timed(pipe, args.runs, warm_steps=2, **no_cfg)}
    print(f"base {args.base_steps} steps + CFG: {result['base_cfg']['seconds']:.2f} s", flush=True)

    lora_path = write_random_lora(
        pipe, args.rank, args.alpha, work / "Qwen-Image-Lightning-random.safetensors"
    )
    begin = time.perf_counter()
    pipe.load_lora(lora_path)
    result["lora_load_s"] = time.perf_counter() - begin
    result["fusion_branch"] = pipe.fusion_summary()
    runs: dict[str, list[float]] = {"branch": [], "merge": []}
    for mode in ("branch", "merge", "merge", "branch"):  # balanced: the GPU's clock drifts under load
        begin = time.perf_counter()
        pipe.set_lora_mode(mode)
        result.setdefault("mode_switch_s", []).append(time.perf_counter() - begin)
        runs[mode].append(timed(pipe, args.runs, warm_steps=2, **no_cfg)["ms_per_step"])
    step["branch"], step["merged"] = (
        {"ms_per_step": statistics.median(runs[m]), "rounds": runs[m]} for m in ("branch", "merge")
    )
    result["ms_per_step"] = {mode: timing["ms_per_step"] for mode, timing in step.items()}
    result["step_runs"] = step
    lightning = {
        "lightning-8 branch": timed(pipe, args.runs, **size, preset="lightning-8", negative_prompt=" ")
    }
    pipe.set_lora_mode("merge")
    result["merge_report"] = pipe.lora_merge.summary()
    for preset in ("lightning-8", "lightning-4"):
        lightning[preset] = timed(pipe, args.runs, **size, preset=preset, negative_prompt=" ")
    result["lightning"] = lightning
    clipping = fp8_input_clipping(pipe, PROMPT, **size, preset="lightning-8", negative_prompt=" ", seed=0)
    result["fp8_input_clipping"] = clipping.summary()

    values = {
        "lightning8_s": lightning["lightning-8"]["seconds"],
        "lightning4_s": lightning["lightning-4"]["seconds"],
        "branch_over_merged": step["branch"]["ms_per_step"] / step["merged"]["ms_per_step"],
    }
    result["targets"] = {
        k: {"value": v, "target": TARGETS[k], "met": v <= TARGETS[k]} for k, v in values.items()
    }
    result["total_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for key, target in result["targets"].items():
        verdict = "met" if target["met"] else "MISSED"
        print(f"{key}: {target['value']:.3f} (target <= {target['target']}) {verdict}")
    print(f"ms/step: {json.dumps({k: round(v, 1) for k, v in result['ms_per_step'].items()})}")
    print(result["merge_report"])
    print(result["fp8_input_clipping"])
    print(f"wrote {args.out} in {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
