"""Kernel-time breakdown of one denoise step on the full-size DiT (random weights), by kernel and by kind.

    python bench/profile_step.py --variant fp8-fused --config 1024x2 --out DIR

Profiles one step after warm-up with the CUDA profiler (`--graph`: a CUDA-graph replay), then times
`--runs` back-to-back steps while sampling the SM clock and power with nvidia-smi, so the kernel sum,
the step time and any clock drop under sustained load can be compared. Writes
DIR/profile_<variant>[-graph]_<config>.{json,md}; `--tables-from FILE.json` rewrites the Markdown of a
stored report (e.g. after changing how kernels are grouped).
"""

import argparse
import json
import subprocess
from pathlib import Path

import torch
from step_bench import VARIANTS, build, step_inputs
from torch import nn
from torch.profiler import ProfilerActivity, profile

from qwen_image_fusion.models.fp8 import Fp8Linear
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig

# H200 SXM dense peaks (NVIDIA's datasheet halves its sparse figures): FP8 and BF16 tensor-core TFLOP/s.
# The roofline columns divide each kind's work by its kernel time and these.
PEAK_TFLOPS = {"fp8 gemm": 1979.0, "bf16 gemm": 989.5, "attention": 989.5}
TEXT_STREAM = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "txt_mlp", "txt_in")
ONE_ROW = ("img_mod", "txt_mod", "time_text_embed", "norm_out.linear")  # read the conditioning vector

KINDS = (  # first match wins: our kernels by name, then FP8 GEMMs (cuBLAS "nvjet_*_qq*", e4m3), then BF16
    ("producers (ours)", ("_layer_norm", "_gated_residual", "_tanh_residual")),
    ("gelu (ours)", ("_gelu",)),
    ("swiglu (ours)", ("_silu_mul",)),
    ("q/k norm+rope (ours)", ("_rms_norm_rope",)),
    ("fp8 quant (ours)", ("_static_quant",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("convolution", ("fprop", "implicit_gemm", "conv2d", "conv3d", "convolution", "winograd", "cudnn")),
    ("fp8 gemm", ("_qqtst", "e4m3", "f8f8", "_fp8_gemv")),
    ("bf16 gemm", ("gemm", "nvjet", "cutlass", "xmma")),
    ("copies/cat", ("copy", "cat", "concat", "memcpy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def clock_power_samples(text: str) -> list[tuple[float, float]]:
    """(SM MHz, W) pairs from nvidia-smi's CSV lines; lines it could not read ("[N/A]") are skipped."""
    samples = []
    for line in text.splitlines():
        try:
            clock, power = (float(v) for v in line.split(","))
        except ValueError:
            continue
        samples.append((clock, power))
    return samples


def step_work(model: nn.Module, batch: int, image: int, text: int) -> dict[str, float]:
    """FLOPs of one step by kind: each linear's `2 x rows x in x out` (FP8 or BF16 by its weights; image,
    text or one row per sample by its name) and attention's `4 x S^2 x width` per block (QK^T and PV, S the
    joint sequence)."""
    work = {"fp8 gemm": 0.0, "bf16 gemm": 0.0, "attention": 0.0}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear | Fp8Linear):
            continue
        rows = text if any(n in name for n in TEXT_STREAM) else image
        rows = 1 if any(n in name for n in ONE_ROW) else rows
        out_features, in_features = module.weight.shape
        kind = "fp8 gemm" if isinstance(module, Fp8Linear) else "bf16 gemm"
        work[kind] += 2.0 * batch * rows * in_features * out_features
    blocks, width = len(model.transformer_blocks), model.config.inner_dim
    work["attention"] = 4.0 * batch * blocks * (image + text) ** 2 * width
    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, default="fp8-fused")
    parser.add_argument("--config", default="1024x2", help="SIZExBATCH")
    parser.add_argument("--text", type=int, default=128)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--graph", action="store_true", help="profile a CUDA-graph replay")
    parser.add_argument("--runs", type=int, default=10, help="back-to-back steps timed after the profile")
    parser.add_argument("--out", type=Path, help="where the JSON and Markdown go")
    parser.add_argument("--tables-from", type=Path, help="rewrite the Markdown of a stored JSON report")
    args = parser.parse_args()
    if args.tables_from:
        print(write_tables(json.loads(args.tables_from.read_text()), args.tables_from.with_suffix(".md")))
        return
    if args.out is None:
        parser.error("--out is required to profile")
    device = torch.device("cuda")
    config = QwenImageConfig(num_layers=args.layers)
    model = build(args.variant, config, device)
    size, batch = (int(v) for v in args.config.split("x"))
    latents, prompt, sigma, grid = step_inputs(config, size, batch, args.text, device)

    def eager():
        if args.variant.startswith("diffusers"):
            return model(latents, prompt, None, sigma, [[grid]] * batch, return_dict=False)[0]
        return model(latents, prompt, None, sigma, grid)

    step = eager
    if args.graph:
        from qwen_image_fusion.pipelines.cuda_graph import GraphedStep

        graphed = GraphedStep(lambda lat, emb, sig: model(lat, emb, None, sig, grid))

        def step():
            return graphed(latents, prompt, sigma)

    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.runs + 3)]
    with torch.no_grad():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            events[0].record()
            step()
            events[1].record()
            torch.cuda.synchronize()
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE,
            text=True,
        )
        events[2].record()
        for i in range(args.runs):
            step()
            events[3 + i].record()
        torch.cuda.synchronize()
        smi.terminate()
    samples = clock_power_samples(smi.communicate()[0])
    runs_ms = [events[2 + i].elapsed_time(events[3 + i]) for i in range(args.runs)]
    kernels = [
        {"kernel": e.key, "count": e.count, "ms": e.device_time_total / 1000}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    report = {
        "variant": args.variant,
        "config": args.config,
        "text": args.text,
        "layers": args.layers,
        "graph": args.graph,
        "step_ms_profiled": events[0].elapsed_time(events[1]),
        "back_to_back_ms": runs_ms,
        "sm_clock_mhz_power_w": samples,
        "kernels": sorted(kernels, key=lambda k: -k["ms"]),
        "work_flops": step_work(model, batch, latents.shape[1], args.text),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"profile_{args.variant}{'-graph' if args.graph else ''}_{args.config}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(write_tables(report, stem.with_suffix(".md")))


def write_tables(report: dict, path: Path) -> str:
    """Writes the Markdown tables (per kind, top kernels) of a profile report; returns the summary part."""
    kinds: dict[str, dict] = {}
    for k in report["kernels"]:
        k["kind"] = kind_of(k["kernel"])
        entry = kinds.setdefault(k["kind"], {"ms": 0.0, "launches": 0})
        entry["ms"] += k["ms"]
        entry["launches"] += k["count"]
    total = sum(k["ms"] for k in report["kernels"])
    runs_ms, samples = report.get("back_to_back_ms", []), report.get("sm_clock_mhz_power_w", [])
    lines = [
        f"# {report['variant']}{' (graph replay)' if report.get('graph') else ''}, {report['config']},"
        f" {report['text']} text tokens: step {report['step_ms_profiled']:.1f} ms under the profiler,"
        f" kernels {total:.1f} ms",
        "",
    ]
    if runs_ms:  # reports from before the back-to-back timing have none
        lines += [f"{len(runs_ms)} back-to-back steps (ms): {', '.join(f'{t:.1f}' for t in runs_ms)}", ""]
    if samples:
        lines += [
            f"SM clock (MHz) / power (W) while timing: min {min(c for c, _ in samples):.0f} /"
            f" max {max(p for _, p in samples):.0f} over {len(samples)} samples",
            "",
        ]
    work = report.get("work_flops", {})

    def roofline(kind: str, ms: float) -> str:
        if kind not in work or not ms:
            return " | |"
        tflops = work[kind] / ms / 1e9
        share = 100 * tflops / PEAK_TFLOPS[kind]
        return f" {work[kind] / 1e12:.2f} TFLOP: {tflops:.0f} TFLOP/s | {share:.0f}% |"

    lines += [
        "| kind | ms | launches | work: achieved | of H200 peak |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {kind} | {v['ms']:.2f} | {v['launches']} |{roofline(kind, v['ms'])}"
            for kind, v in sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])
        ),
    ]
    if work:
        floor = sum(work[k] / PEAK_TFLOPS[k] / 1e9 for k in work)
        lines += ["", f"At the H200's peaks this work takes at least {floor:.1f} ms (GEMMs and attention)."]
    summary = "\n".join(lines)
    lines += [
        "",
        "| kernel | kind | launches | ms |",
        "|---|---|---:|---:|",
        *(
            f"| `{k['kernel'][:100]}` | {k['kind']} | {k['count']} | {k['ms']:.2f} |"
            for k in report["kernels"][:30]
        ),
    ]
    path.write_text("\n".join(lines) + "\n")
    return summary


if __name__ == "__main__":
    main()
