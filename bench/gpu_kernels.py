"""Split (BF16 producer, then the static quantizer) vs fused producer kernels on one CUDA GPU.

    python bench/gpu_kernels.py --out DIR

Times each variant replayed from a CUDA graph (triton.testing.do_bench_cudagraph, median: kernel time
without host launch overhead, as `generate()` runs them) and, for reference, with plain launches
(do_bench); checks that split and fused give the same
bytes, and reports achieved bandwidth against the bytes each variant must move. Writes
DIR/gpu_kernels.json and DIR/gpu_kernels.md.
"""

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from qwen_image_fusion.kernels.gelu_quant import (
    gelu_tanh_quant_torch,
    gelu_tanh_quant_triton,
    gelu_tanh_triton,
)
from qwen_image_fusion.kernels.norm_modulate import (
    gated_residual_layer_norm_modulate_torch,
    gated_residual_layer_norm_modulate_triton,
    layer_norm_modulate_torch,
    layer_norm_modulate_triton,
)
from qwen_image_fusion.kernels.quant import inverse_scale, static_quant_fp8_triton

EPS = 1e-6


def _inputs(rows: int, width: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows)
    act = [torch.randn(1, rows, width, device="cuda", generator=g).bfloat16() for _ in range(2)]
    mod = (0.5 * torch.randn(1, 6 * width, device="cuda", generator=g)).bfloat16()
    gate, shift, scale = mod[:, :width], mod[:, 3 * width : 4 * width], mod[:, 4 * width : 5 * width]
    return {"res": act[0], "x": act[1], "gate": gate, "shift": shift, "scale": scale}


def _producer1(t: dict, inv: torch.Tensor) -> dict[str, tuple[Callable, int]]:
    """Variants of producer 1 -> (callable returning q, bytes moved in units of rows*D)."""
    args = (t["x"], t["shift"], t["scale"], EPS)
    return {
        "split": (lambda: static_quant_fp8_triton(layer_norm_modulate_triton(*args)[0], inv), 2 + 2 + 2 + 1),
        "fused": (lambda: layer_norm_modulate_triton(*args, inv, write_y=False)[1], 2 + 1),
        "fused+y": (lambda: layer_norm_modulate_triton(*args, inv)[1], 2 + 2 + 1),
        "torch": (lambda: layer_norm_modulate_torch(*args, inv, write_y=False)[1], 2 + 1),
    }


def _producer2(t: dict, inv: torch.Tensor) -> dict[str, tuple[Callable, int]]:
    """Variants of producer 2 (r is always written) -> (callable returning q, bytes in rows*D)."""
    args = (t["res"], t["gate"], t["x"], t["shift"], t["scale"], EPS)
    return {
        "split": (
            lambda: static_quant_fp8_triton(gated_residual_layer_norm_modulate_triton(*args)[1], inv),
            4 + 2 + 2 + 2 + 1,
        ),
        "fused": (lambda: gated_residual_layer_norm_modulate_triton(*args, inv, write_y=False)[2], 4 + 2 + 1),
        "fused+y": (lambda: gated_residual_layer_norm_modulate_triton(*args, inv)[2], 4 + 2 + 2 + 1),
        "torch": (lambda: gated_residual_layer_norm_modulate_torch(*args, inv, write_y=False)[2], 4 + 2 + 1),
    }


def _gelu(t: dict, inv: torch.Tensor) -> dict[str, tuple[Callable, int]]:
    """Variants of GELU + quant on the MLP hidden state -> (callable returning q, bytes in rows*width)."""
    h = t["x"]
    return {
        "split": (lambda: static_quant_fp8_triton(gelu_tanh_triton(h), inv), 2 + 2 + 2 + 1),
        "fused": (lambda: gelu_tanh_quant_triton(h, inv)[1], 2 + 1),
        "fused+y": (lambda: gelu_tanh_quant_triton(h, inv, write_g=True)[1], 2 + 2 + 1),
        "torch": (lambda: gelu_tanh_quant_torch(h, inv), 2 + 1),
    }


def run(rows_list: list[int], hidden: int) -> list[dict]:
    inv = inverse_scale(torch.tensor(0.02, device="cuda"))
    results = []
    ops = [("ln_mod", _producer1, hidden), ("res_ln_mod", _producer2, hidden), ("gelu", _gelu, 4 * hidden)]
    for op, make, width in ops:
        for rows in rows_list:
            variants = make(_inputs(rows, width), inv)
            split_q = variants["split"][0]().view(torch.uint8)
            for name, (fn, units) in variants.items():
                ms = do_bench_cudagraph(fn, rep=100, return_mode="median")
                launched_ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                moved = units * rows * width
                row = {"op": op, "rows": rows, "width": width, "variant": name, "ms": ms, "bytes": moved}
                row["launched_ms"] = launched_ms
                row["gbps"] = moved / ms / 1e6
                # the eager torch twin may differ through the LN sum order: not compared
                same = None if name == "torch" else torch.equal(fn().view(torch.uint8), split_q)
                row["same_bytes_as_split"] = same
                results.append(row)
                print(
                    f"{op:10s} rows={rows:5d} D={width:5d} {name:8s} {ms * 1e3:8.1f} us "
                    f"(launched {launched_ms * 1e3:8.1f} us) "
                    f"{row['gbps']:7.0f} GB/s same={same}"
                )
    return results


def markdown(results: list[dict]) -> str:
    by_key = {(r["op"], r["rows"], r["variant"]): r for r in results}
    lines = [
        "| op | rows | D | split us (GB/s) | fused us (GB/s) | fused+y us | torch us | split/fused "
        "| launched: split / fused us |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for op, rows in dict.fromkeys((r["op"], r["rows"]) for r in results):
        s, f, fy, t = (by_key[(op, rows, v)] for v in ("split", "fused", "fused+y", "torch"))
        lines.append(
            f"| {op} | {rows} | {s['width']} | {s['ms'] * 1e3:.1f} ({s['gbps']:.0f}) | "
            f"{f['ms'] * 1e3:.1f} ({f['gbps']:.0f}) | {fy['ms'] * 1e3:.1f} | {t['ms'] * 1e3:.1f} | "
            f"{s['ms'] / f['ms']:.2f}x | {s['launched_ms'] * 1e3:.1f} / {f['launched_ms'] * 1e3:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 128, 1024, 4096, 6889])
    parser.add_argument("--hidden", type=int, default=3072)
    args = parser.parse_args()
    results = run(args.rows, args.hidden)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_kernels.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    header = f"Split vs fused producers on {env['device']} (torch {env['torch']}, triton {env['triton']}); "
    header += "median of CUDA-graph replays (do_bench_cudagraph); GB/s over the bytes each variant "
    header += "must move; last column: the same with plain launches (do_bench).\n\n"
    (args.out / "gpu_kernels.md").write_text(header + markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
