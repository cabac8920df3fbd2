"""GPU-memory budgets on one GPU (issue 24): seconds per 1024x1024 image, peaks, bytes moved, per budget.

One process loads the checkpoint once (the full-size random FP8 one of bench/make_random_checkpoint.py);
for each budget (uncapped, then 48, 32, 24, 16 GiB) `Pipeline.set_gpu_memory` places the weights again in
place and caps the process there (torch's per-process memory fraction). At each budget, at 1024x1024:
- 50 steps with true CFG: a warm-up (graph capture), then one run of --steps steps (default 6) timed per
  stage; seconds per image = text + 50 x the measured step + decode (extrapolated: the JSON says so);
- Lightning-8 (8 steps, CFG off, the preset's scheduler; without its LoRA file: a merged LoRA costs
  nothing per step, BENCHMARKS.md session 4): a warm-up, then one timed run;
- peak allocated and reserved memory over the budget's runs (checked <= budget), the peaks the plan
  expected, its bytes per step and per request, host RSS after placing;
- the SHA256 of the --steps run's final latents (the same at every budget) and of its PNG (the same where
  the plan decodes whole; tiled decoding changes pixels by design);
- at 24 GiB also eager steps (no CUDA graphs) and two blocks of prefetch instead of one.
An Edit checkpoint edits one 1024x1024 input image (`--input-images`), its Lightning preset being
edit-lightning-8; a family without a Lightning preset (Qwen-Image 2.1) skips that run. The host link's
bandwidth is measured once (a 1 GiB pinned copy on a side stream); each budget's step is projected for a
PCIe 4.0 x16 link (25 GB/s) as max(uncapped step, bytes per step / 25 GB/s): a stream that overlaps
compute completely, the best case.

    python bench/memory_bench.py --model /tmp/qwen-image-random-fp8 --out memory_bench.json   # ~4 min
"""

import argparse
import gc
import hashlib
import io
import json
import time
from pathlib import Path

import PIL.Image
import torch

from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.models.streaming import CudaLink
from qwen_image_fusion.pipelines import load_pipeline, memory_plan
from qwen_image_fusion.pipelines.memory_plan import GiB
from qwen_image_fusion.pipelines.presets import get_preset, presets_for
from qwen_image_fusion.pipelines.requests import builtin_edit_set

PROMPT = "a red fox in the snow, detailed fur, golden hour"
SIZE = 1024
PCIE4_X16 = 25e9  # bytes/s a PCIe 4.0 x16 link moves in practice (31.5 GB/s raw)


def host_memory() -> dict[str, float]:
    """This process's resident host memory now and at its peak, GiB (anonymous and file-backed now)."""
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    kib = {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    return {k: v / 1024**2 for k, v in kib.items()}


def link_bandwidth(device: torch.device, nbytes: int = GiB) -> float:
    """Bytes/s of a pinned host-to-device copy on a side stream (median of 3)."""
    link = CudaLink(device)
    host, target = link.host_buffer(nbytes), torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    link.pin(host)
    times = []
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(link.stream)
        link.copy(target, host)
        end.record(link.stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return nbytes / sorted(times[1:])[1]


def sha(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def latents_sha(pipe) -> dict[str, str]:
    """Record the SHA256 of the latents each `generate` decodes (before any tiled decoding) under "last"."""
    seen: dict[str, str] = {}
    decode = pipe.model.decode

    def recording(latents, *args, **kwargs):
        seen["last"] = hashlib.sha256(latents.float().cpu().numpy().tobytes()).hexdigest()
        return decode(latents, *args, **kwargs)

    pipe.model.decode = recording
    return seen


def input_images(count: int) -> list:
    """`count` SIZE x SIZE input images (an edit's): the drawn scenes of the built-in edit set."""
    scenes = builtin_edit_set("edit")
    return [
        PIL.Image.open(scenes[i % len(scenes)].images[0]).convert("RGB").resize((SIZE, SIZE))
        for i in range(count)
    ]


def timed(pipe, steps: int, **kwargs) -> dict:
    """One warm-up (2 steps: graph capture), then a timed run; its stage seconds, image and latents hashes."""
    if pipe.inputs:
        kwargs["image"] = pipe.inputs
    pipe.generate(PROMPT, seed=0, width=SIZE, height=SIZE, num_inference_steps=2, **kwargs)
    image = pipe.generate(PROMPT, seed=1, width=SIZE, height=SIZE, num_inference_steps=steps, **kwargs)[0]
    run = pipe.last_run
    return {
        "timings": run.timings,
        "ms_per_step": run.ms_per_step,
        "steps": steps,
        "sha256": sha(image),
        "latents_sha256": pipe.latents_seen["last"],
        "tiled_decode": pipe.memory.plan.tiled_decode,
    }


def workload(pipe) -> Workload:
    return Workload(SIZE, SIZE, input_images=len(pipe.inputs))


def run_budget(pipe, budget: int | None, steps: int) -> dict:
    """Place for `budget`, then the CFG run (extrapolated to 50 steps) and Lightning-8."""
    start = time.perf_counter()
    pipe.set_gpu_memory(budget, workload(pipe))
    gc.collect()
    torch.cuda.empty_cache()
    placed = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    plan = pipe.memory.plan
    cfg = timed(pipe, steps, negative_prompt=" ", true_cfg_scale=4.0)
    t = cfg["timings"]
    cfg["seconds_50_steps"] = t["text_encoding"] + 50 * cfg["ms_per_step"] / 1000 + t["decoding"]
    cfg["extrapolated"] = f"text + 50 x the step measured over {steps} steps + decode"
    lightning = None
    if pipe.lightning is not None:
        lightning = timed(pipe, 8, preset=pipe.lightning)
        lightning["seconds"] = lightning["timings"]["total"]
    peak_allocated, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {
        "budget_gib": None if budget is None else budget / GiB,
        "plan": plan.describe(),
        "summary": plan.summary(),
        "expected_peaks_gib": {phase: size / GiB for phase, size in plan.peaks.items()},
        "bytes_per_step": plan.bytes_per_step,
        "bytes_per_request": plan.bytes_per_request,
        "place_seconds": placed,
        "cfg_50": cfg,
        "lightning_8": lightning,
        "peak_allocated_gib": peak_allocated / GiB,
        "peak_reserved_gib": peak_reserved / GiB,
        "peak_ok": budget is None or peak_reserved <= budget,
        "host_memory_gib": host_memory(),
    }


def report(entry: dict) -> str:
    cfg, lightning = entry["cfg_50"], entry["lightning_8"]
    eight = "" if lightning is None else f"Lightning-8 {lightning['seconds']:.2f} s, "
    return (
        f"{entry['budget_gib'] or 'uncapped'}: {cfg['seconds_50_steps']:.2f} s per 50-step image "
        f"({cfg['ms_per_step']:.0f} ms/step), {eight}peak "
        f"{entry['peak_reserved_gib']:.1f} GiB reserved, {entry['bytes_per_step'] / 1e9:.1f} GB/step"
    )


def compare(result: dict) -> None:
    """Each budget against the uncapped run, the link time of its bytes, and the PCIe 4.0 projection."""
    uncapped = result["budgets"][0]
    for entry in result["budgets"]:
        entry["x_uncapped_50_steps"] = (
            entry["cfg_50"]["seconds_50_steps"] / uncapped["cfg_50"]["seconds_50_steps"]
        )
        if entry["lightning_8"] is not None:
            lightning = entry["lightning_8"]["seconds"] / uncapped["lightning_8"]["seconds"]
            entry["x_uncapped_lightning"] = lightning
        entry["link_seconds_per_step"] = entry["bytes_per_step"] / result["link_bytes_per_s"]
        resident_step = uncapped["cfg_50"]["ms_per_step"] / 1000
        entry["pcie4_projected_step_s"] = max(resident_step, entry["bytes_per_step"] / PCIE4_X16)
    budgets = result["budgets"]
    result["same_latents_at_every_budget"] = len({e["cfg_50"]["latents_sha256"] for e in budgets}) == 1
    whole = {e["cfg_50"]["sha256"] for e in budgets if not e["cfg_50"]["tiled_decode"]}
    result["same_image_where_decoded_whole"] = len(whole) == 1


def at_24_gib(pipe, steps: int, uncapped_sha: str) -> dict:
    """Eager steps (no CUDA graphs) and two blocks of prefetch, at 24 GiB."""
    pipe.set_gpu_memory(24 * GiB, workload(pipe))
    pipe.cuda_graphs = False
    eager = timed(pipe, steps, negative_prompt=" ", true_cfg_scale=4.0)
    pipe.cuda_graphs = True
    memory_plan.PREFETCH = 2  # read when placing: slots = PREFETCH + 1
    try:
        pipe.set_gpu_memory(24 * GiB, workload(pipe))
        ahead = timed(pipe, steps, negative_prompt=" ", true_cfg_scale=4.0)
        summary = pipe.memory.plan.summary()
    finally:
        memory_plan.PREFETCH = 1
    return {
        "eager_ms_per_step": eager["ms_per_step"],
        "two_ahead_ms_per_step": ahead["ms_per_step"],
        "two_ahead_summary": summary,
        "same_latents": eager["latents_sha256"] == ahead["latents_sha256"] == uncapped_sha,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="FP8 checkpoint (bench/make_random_checkpoint.py)")
    parser.add_argument("--budgets", default="48,32,24,16", help="GiB, after the uncapped run")
    parser.add_argument("--steps", type=int, default=6, help="timed CFG steps (extrapolated to 50)")
    parser.add_argument("--input-images", type=int, help="per request (default: 1 for an Edit checkpoint)")
    parser.add_argument("--no-24-extras", action="store_true", help="skip eager and two-ahead at 24 GiB")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    pipe = load_pipeline(args.model, device="cuda")
    pipe.latents_seen = latents_sha(pipe)
    count = args.input_images if args.input_images is not None else int(pipe.spec.images_required)
    pipe.inputs = input_images(count)
    lightning = "edit-lightning-8" if pipe.inputs else "lightning-8"
    pipe.lightning = lightning if get_preset(lightning) in presets_for(pipe.spec.family.name) else None
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "load_seconds": time.perf_counter() - start,
        "host_memory_after_load_gib": host_memory(),
        "link_bytes_per_s": link_bandwidth(pipe.device),
        "pcie4_x16_bytes_per_s": PCIE4_X16,
        "budgets": [],
    }
    print(f"loaded in {result['load_seconds']:.0f} s, link {result['link_bytes_per_s'] / 1e9:.1f} GB/s")
    for budget in [None, *(round(float(b) * GiB) for b in args.budgets.split(","))]:
        result["budgets"].append(run_budget(pipe, budget, args.steps))
        print(report(result["budgets"][-1]), flush=True)
    compare(result)
    if not args.no_24_extras:
        result["at_24_gib"] = at_24_gib(pipe, args.steps, result["budgets"][0]["cfg_50"]["latents_sha256"])
    pipe.set_gpu_memory(None)
    result["total_seconds"] = time.perf_counter() - start
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "budgets"}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
