"""FP8 GEMM on the DiT block shapes: torch._scaled_mm (cuBLASLt) vs our Triton candidates, and the MLP
up-projection with GELU(tanh) + FP8 quant in the GEMM's epilogue (issue 53 parts 2-3).

    python bench/fp8_gemm_bench.py --out DIR [--budget-s 170] [--modes precise,fast] [--quick]

Shapes: rows M in {256 (text), 4096 (a 1024x1024 image branch), 8192 (2048x1024, Edit)} times the block
linears the model runs (models/qwen_image/transformer.py: q/k/v/out 3072 <- 3072, MLP up 12288 <- 3072 with
GELU, MLP down 3072 <- 12288) and a fused q/k/v (9216 <- 3072, a lever: the model runs three GEMMs). All with
the layer's bf16 bias, as the model calls `_scaled_mm`. The modulation linears (18432 <- 3072) see one row
per sample: a GEMV, not measured here.

Candidates: `_scaled_mm` with per-tensor scales, `use_fast_accum` False (the model's) and True; ours from
kernels/fp8_gemm.py: `tiled`, `persistent` (TMA descriptors) and `persistent` with `warp_specialize`, each
over a small hand-picked config list, in "precise" (fp32 promotion every BLOCK_K, like cuBLASLt without fast
accumulation) and "fast" (Hopper's tensor-core accumulator over all of K) accumulation. Every config's time
is recorded; the best per candidate is picked here, by timing, not by triton.autotune.

Timing: CUDA events around each call, 5 warm-up calls after the first (compiling) call, median of --reps
(>= 20) calls; L2 is NOT flushed between calls (weights and activations of these sizes partly stay in the
50-60 MB L2, as they would not in the model: a slight advantage to every candidate alike). TFLOPS = 2MNK /
time; % of the device's dense FP8 peak, read from the device name.
Checks: each output against the exact product (float64 sums of the E4M3 inputs, scales and bias) and
against `_scaled_mm` (precise); a candidate whose error is more than 1% of max |exact| (or NaN) is marked
wrong and never picked. The epilogue's FP8 bytes must equal our own GEMM's bf16 output fed to
kernels/gelu_quant.py's kernel (the fused == unfused contract), byte for byte.

Writes DIR/fp8_gemm_bench.json (after every shape: a timeout keeps what was measured) and
DIR/fp8_gemm_bench.md; prints progress and the tables.
"""

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

WRONG_REL = 1e-2  # max |out - exact| / max |exact| above this: wrong
SHAPES = [  # (label, N, K)
    ("qkv/out 3072<-3072", 3072, 3072),
    ("qkv fused 9216<-3072 (lever)", 9216, 3072),
    ("mlp up 12288<-3072", 12288, 3072),
    ("mlp down 3072<-12288", 3072, 12288),
]
ROWS = [4096, 8192, 256]  # the image branch first: what matters most is measured first


def fail(message: str) -> None:
    print(f"fp8_gemm_bench: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def log(message: str) -> None:
    print(message, flush=True)


def peak_tflops(name: str) -> float | None:
    """The dense FP8 peak of bench/profile_step.py's table (one table of the devices we measured on), None for
    a device not in it."""
    from profile_step import PEAKS

    return next((peak.fp8_tflops for key, peak in PEAKS.items() if key in name), None)


def error_text(error: Exception) -> str:
    """`Type: first line of the message` (300 characters at most), for a config that failed."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def configs(quick: bool) -> dict[str, list]:
    """Hand-picked tiles per candidate (kernels/fp8_gemm.py's GemmConfig fields, precise set below).
    Shared-memory budget on sm_90: 227 KB; A+B stage = (BM + BN) * BK bytes; the TMA store adds BM*BN*2."""
    from qwen_image_fusion.kernels.fp8_gemm import GemmConfig as C

    tiled = [
        C(128, 256, 128, 8, 3, 8),
        C(256, 128, 128, 8, 3, 8),
        C(128, 128, 128, 8, 4, 8),
        C(128, 128, 128, 8, 5, 4),
        C(128, 256, 64, 8, 4, 8),
        C(64, 256, 128, 8, 4, 4),
        C(128, 64, 128, 8, 5, 4),
    ]
    persistent = [
        C(128, 256, 128, 8, 3, 8),
        C(256, 128, 128, 8, 3, 8),
        C(128, 128, 128, 8, 4, 8),
        C(128, 128, 128, 8, 5, 4),
        C(128, 256, 64, 8, 4, 8),
        C(128, 64, 128, 8, 5, 4),
    ]
    ws = [
        C(128, 256, 128, 8, 3, 8, warp_specialize=True),
        C(128, 128, 128, 8, 4, 8, warp_specialize=True),
        C(128, 128, 128, 8, 4, 4, warp_specialize=True),
        C(128, 256, 64, 8, 4, 8, warp_specialize=True),
    ]
    if quick:
        tiled, persistent, ws = tiled[:3], persistent[:3], ws[:2]
    return {"tiled": tiled, "persistent": persistent, "persistent-ws": ws}


def time_ms(fn, reps: int) -> tuple[float, float, list[float]]:
    """(first call incl. compile, s; median ms; all ms) of `fn` with CUDA events, L2 not flushed."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(5):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return first_s, statistics.median(times), times


def inputs(m: int, n: int, k: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(m, k, device="cuda", generator=g).clamp(-8, 8).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda", generator=g).clamp(-8, 8).to(torch.float8_e4m3fn)
    bias = (0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    # outputs of order 1 (the bias is a small part of them): sum of K unit products ~ sqrt(K)
    scale_a = torch.tensor(0.1, device="cuda")
    scale_b = torch.tensor(0.2 * (3072 / k) ** 0.5, device="cuda")
    exact = (a.double() @ w.double().t()) * (scale_a.double() * scale_b.double()) + bias.double()
    return {"a": a, "w": w, "bias": bias, "scale_a": scale_a, "scale_b": scale_b, "exact": exact}


def errors(out: torch.Tensor, t: dict, cublas: torch.Tensor | None) -> dict:
    exact = t["exact"]
    diff = (out.double() - exact).abs()
    peak = exact.abs().max().item()
    row = {
        "finite": bool(torch.isfinite(out).all()),
        "err_max_rel": diff.max().item() / peak,
        "err_mean_rel": diff.mean().item() / exact.abs().mean().item(),
    }
    if cublas is not None:
        d = (out.float() - cublas.float()).abs()
        row["vs_cublas_max_abs"] = d.max().item()
        row["vs_cublas_max_rel"] = d.max().item() / cublas.float().abs().max().item()
        row["vs_cublas_equal_frac"] = (
            (out.view(torch.int16) == cublas.view(torch.int16)).float().mean().item()
        )
    row["wrong"] = not row["finite"] or row["err_max_rel"] > WRONG_REL
    return row


class Bench:
    def __init__(self, args, peak: float | None):
        self.args, self.peak = args, peak
        self.start = time.perf_counter()
        self.rows: list[dict] = []
        self.epilogue: list[dict] = []
        self.broken: dict[str, str] = {}  # candidate name -> compile / launch error

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.budget_s

    def record(self, base: dict, name: str, fn, t: dict, cublas, flop: float, extra: dict) -> dict | None:
        row = {**base, "candidate": name, **extra}
        if name in self.broken:
            return None
        if self.over_budget():
            row["status"] = "skipped (time budget)"
            self.rows.append(row)
            return row
        try:
            out = fn()
            torch.cuda.synchronize()
            if out is None:
                raise RuntimeError("the guard rejected the inputs")
            first_s, ms, times = time_ms(fn, self.args.reps)
        except Exception as error:  # a config the compiler or the device refuses: recorded, then skipped
            self.broken[name] = error_text(error)
            log(f"  {name}: FAILED {self.broken[name]}")
            traceback.print_exc(limit=2, file=sys.stdout)
            row["status"] = "error: " + self.broken[name]
            self.rows.append(row)
            return row
        tflops = flop / ms / 1e9
        row.update(errors(out, t, cublas))
        row.update(
            status="wrong" if row["wrong"] else "ok",
            ms=ms,
            ms_min=min(times),
            first_call_s=first_s,
            tflops=tflops,
            pct_peak=None if self.peak is None else 100 * tflops / self.peak,
        )
        self.rows.append(row)
        log(
            f"  {name:44s} {ms * 1e3:8.1f} us {tflops:7.0f} TF"
            + ("" if self.peak is None else f" {row['pct_peak']:5.1f}%")
            + f" err {row['err_max_rel']:.1e} first {first_s:5.2f}s"
            + (" WRONG" if row["wrong"] else "")
        )
        return row

    def shape(self, label: str, m: int, n: int, k: int, sweep: dict[str, list], modes: list[str]) -> None:
        from qwen_image_fusion.kernels.fp8_gemm import fp8_gemm_triton

        log(f"[{self.elapsed():6.1f}s] M={m} N={n} K={k} ({label})")
        t = inputs(m, n, k)
        flop = 2.0 * m * n * k
        base = {"shape": label, "M": m, "N": n, "K": k}
        a, w, bias, sa, sb = t["a"], t["w"], t["bias"], t["scale_a"], t["scale_b"]
        cublas = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)
        for fast in (False, True):
            fn = lambda fast=fast: torch._scaled_mm(  # noqa: E731
                a, w.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=fast
            )
            mode = "fast" if fast else "precise"
            self.record(base, f"cublas-{mode}", fn, t, cublas, flop, {"family": "cublas", "mode": mode})
        for family, cfgs in sweep.items():
            kernel = "tiled" if family == "tiled" else "persistent"
            for mode in modes:
                for cfg in cfgs:
                    cfg = replace(cfg, precise=mode == "precise")
                    fn = lambda cfg=cfg, kernel=kernel: fp8_gemm_triton(  # noqa: E731
                        a, w, sa, sb, bias, kernel=kernel, config=cfg
                    )
                    extra = {"family": family, "mode": mode, "kernel": kernel, "config": asdict(cfg)}
                    self.record(base, f"{family}:{cfg.name()}", fn, t, cublas, flop, extra)
        del t, cublas
        torch.cuda.empty_cache()

    def best(self, m: int, n: int, k: int, family: str, mode: str) -> dict | None:
        return _fastest(ok_rows(self.rows, m, n, k), family, mode)

    def epilogue_shape(self, m: int, families: list[str], modes: list[str]) -> None:
        """MLP up-projection + GELU + quant: cuBLASLt then our GELU+quant kernel, our GEMM then the same
        kernel, our GEMM with the epilogue; fused bytes must equal our GEMM -> gelu_quant."""
        from qwen_image_fusion.kernels.fp8_gemm import GemmConfig, fp8_gemm_triton
        from qwen_image_fusion.kernels.gelu_quant import gelu_tanh_quant_triton
        from qwen_image_fusion.kernels.quant import inverse_scale

        n, k = next((n, k) for label, n, k in SHAPES if label.startswith("mlp up"))
        log(f"[{self.elapsed():6.1f}s] epilogue M={m} N={n} K={k}: GEMM + GELU(tanh) + FP8 quant")
        t = inputs(m, n, k)
        a, w, bias, sa, sb = t["a"], t["w"], t["bias"], t["scale_a"], t["scale_b"]
        flop = 2.0 * m * n * k
        h_cublas = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)
        amax = torch.nn.functional.gelu(h_cublas.float(), approximate="tanh").abs().max()
        inv = inverse_scale(amax / 448)  # static scale: set once here, a device tensor in the kernels
        base = {"M": m, "N": n, "K": k}

        def unfused_cublas(fast: bool):
            h = torch._scaled_mm(
                a, w.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=fast
            )
            return gelu_tanh_quant_triton(h, inv)[1]

        q_cublas = unfused_cublas(False)

        def run(name: str, fn, extra: dict, reference: torch.Tensor | None) -> None:
            row = {**base, "candidate": name, **extra}
            if self.over_budget():
                row["status"] = "skipped (time budget)"
                self.epilogue.append(row)
                return
            try:
                q = fn()
                first_s, ms, _ = time_ms(fn, self.args.reps)
            except Exception as error:
                row["status"] = f"error: {error_text(error)}"
                log(f"  {name}: FAILED {row['status']}")
                self.epilogue.append(row)
                return
            row.update(status="ok", ms=ms, first_call_s=first_s, gemm_tflops=flop / ms / 1e9)
            row["bytes_differ_vs_cublas_chain"] = int(
                (q.view(torch.uint8) != q_cublas.view(torch.uint8)).sum()
            )
            if reference is not None:
                differ = int((q.view(torch.uint8) != reference.view(torch.uint8)).sum())
                row["bytes_differ_vs_own_unfused"] = differ
                row["fused_equals_unfused"] = differ == 0
            self.epilogue.append(row)
            same = row.get("fused_equals_unfused")
            log(
                f"  {name:52s} {ms * 1e3:8.1f} us (GEMM {row['gemm_tflops']:5.0f} TF)"
                + ("" if same is None else f" fused==unfused {same}")
                + f" bytes != cuBLAS chain {row['bytes_differ_vs_cublas_chain']}"
            )

        for fast in (False, True):
            mode = "fast" if fast else "precise"
            run(f"cublas-{mode} -> gelu_quant", lambda fast=fast: unfused_cublas(fast), {"mode": mode}, None)
        for family in families:
            for mode in modes:
                best = self.best(m, n, k, family, mode)
                if best is None:
                    continue
                cfg = GemmConfig(**best["config"])
                kernel = best["kernel"]
                gemm = lambda cfg=cfg, kernel=kernel: fp8_gemm_triton(  # noqa: E731
                    a, w, sa, sb, bias, kernel=kernel, config=cfg
                )
                fused = lambda cfg=cfg, kernel=kernel: fp8_gemm_triton(  # noqa: E731
                    a, w, sa, sb, bias, inv, kernel=kernel, config=cfg
                )
                extra = {"family": family, "mode": mode, "kernel": kernel, "config": asdict(cfg)}
                unfused = lambda g=gemm: gelu_tanh_quant_triton(g(), inv)[1]  # noqa: E731
                run(f"{family}:{cfg.name()} -> gelu_quant", unfused, {**extra, "variant": "unfused"}, None)
                own_unfused = gelu_tanh_quant_triton(gemm(), inv)[1]
                run(
                    f"{family}:{cfg.name()} fused epilogue", fused, {**extra, "variant": "fused"}, own_unfused
                )
        del t
        torch.cuda.empty_cache()


def ok_rows(rows: list[dict], m: int, n: int, k: int) -> list[dict]:
    """The timed, correct rows of one shape."""
    return [r for r in rows if (r["M"], r["N"], r["K"]) == (m, n, k) and r.get("status") == "ok"]


def _fastest(rows: list[dict], family: str | None = None, mode: str | None = None, ours: bool = False):
    pick = [
        r
        for r in rows
        if (family is None or r["family"] == family)
        and (mode is None or r["mode"] == mode)
        and (not ours or r["family"] != "cublas")
    ]
    return min(pick, key=lambda r: r["ms"]) if pick else None


def summary(rows: list[dict], peak: float | None) -> list[dict]:
    def brief(r: dict | None) -> dict | None:
        return None if r is None else {
            "candidate": r["candidate"], "ms": r["ms"], "tflops": r["tflops"],
            "pct_peak": r["pct_peak"], "err_max_rel": r["err_max_rel"],
        }  # fmt: skip

    out = []
    for m, n, k, label in dict.fromkeys((r["M"], r["N"], r["K"], r["shape"]) for r in rows):
        mine = ok_rows(rows, m, n, k)
        entry = {"shape": label, "M": m, "N": n, "K": k}
        for family in ("cublas", "tiled", "persistent", "persistent-ws"):
            for mode in ("precise", "fast"):
                entry[f"{family}/{mode}"] = brief(_fastest(mine, family, mode))
        for mode in ("precise", "fast"):
            ours, ref = _fastest(mine, mode=mode, ours=True), _fastest(mine, "cublas", mode)
            entry[f"ours/{mode}"] = brief(ours)
            entry[f"speedup_best_ours_vs_cublas/{mode}"] = (
                None if ours is None or ref is None else ref["ms"] / ours["ms"]
            )
        out.append(entry)
    return out


def markdown(summ: list[dict], epilogue: list[dict], env: dict) -> str:
    def cell(x):
        if x is None:
            return "-"
        pct = "" if x["pct_peak"] is None else f" {x['pct_peak']:.0f}%"
        return f"{x['ms'] * 1e3:.0f} us {x['tflops']:.0f} TF{pct}"

    lines = [
        f"FP8 GEMM with bias on {env['device']} (peak {env['peak_tflops']} TF dense FP8; "
        f"torch {env['torch']}, triton {env['triton']}); median of {env['reps']} CUDA-event timings, "
        "L2 not flushed.",
        "",
        "| M | N<-K | cuBLAS precise | ours precise (best) | x | cuBLAS fast | ours fast (best) | x |"
        " tiled precise | persistent precise | ws precise |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    for e in summ:
        sp = e["speedup_best_ours_vs_cublas/precise"]
        sf = e["speedup_best_ours_vs_cublas/fast"]
        lines.append(
            f"| {e['M']} | {e['N']}<-{e['K']} | {cell(e['cublas/precise'])} | "
            f"{cell(e['ours/precise'])} | "
            f"{'-' if sp is None else f'{sp:.2f}'} | {cell(e['cublas/fast'])} | {cell(e['ours/fast'])} | "
            f"{'-' if sf is None else f'{sf:.2f}'} | {cell(e['tiled/precise'])} | "
            f"{cell(e['persistent/precise'])} | {cell(e['persistent-ws/precise'])} |"
        )
    if epilogue:
        lines += [
            "",
            "MLP up-projection + GELU(tanh) + FP8 quant (q only):",
            "",
            "| M | candidate | us | fused == own unfused | q bytes != cuBLAS chain |",
            "|---:|---|---:|---|---:|",
        ]
        for r in epilogue:
            us = f"{r['ms'] * 1e3:.0f}" if "ms" in r else r["status"]
            same, differ = r.get("fused_equals_unfused", ""), r.get("bytes_differ_vs_cublas_chain", "")
            lines.append(f"| {r['M']} | {r['candidate']} | {us} | {same} | {differ} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--budget-s", type=float, default=170.0, help="stop starting new timings after this")
    parser.add_argument("--modes", default="precise,fast", help="our accumulation modes to sweep")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--epilogue-rows", type=int, nargs="*", default=[4096, 8192])
    parser.add_argument("--quick", action="store_true", help="a third of the configs")
    args = parser.parse_args()
    if args.reps < 20:
        fail("--reps must be >= 20 (the median of at least 20 timings)")
    if not torch.cuda.is_available():
        fail("needs a CUDA GPU (FP8 tensor cores, capability 8.9+); torch sees none. Nothing was measured.")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        fail(f"needs FP8 tensor cores (capability 8.9+); this GPU has {capability}. Nothing was measured.")
    try:
        import triton
    except ImportError:
        fail("needs Triton (pip install triton); it is not installed. Nothing was measured.")

    from qwen_image_fusion.kernels.fp8_gemm import warp_specialize_available

    name = torch.cuda.get_device_name()
    peak = peak_tflops(name)
    modes = [m for m in args.modes.split(",") if m]
    sweep = configs(args.quick)
    env = {
        "device": name,
        "capability": list(capability),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "peak_tflops": peak,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "reps": args.reps,
        "l2_flushed": False,
        "warp_specialize_in_tl_range": warp_specialize_available(),
        "wrong_if_err_max_rel_above": WRONG_REL,
    }
    if not env["warp_specialize_in_tl_range"]:
        sweep.pop("persistent-ws")
    log(f"device {name} (sm_{capability[0]}{capability[1]}, {env['sms']} SMs), peak {peak} TF dense FP8")
    log(f"torch {torch.__version__}, triton {triton.__version__}; L2 not flushed between timed calls")
    if capability[0] != 9:
        log("note: the configs were picked for sm_90 (Hopper); other devices may reject some")
    bench = Bench(args, peak)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fp8_gemm_bench.json"

    def save() -> list[dict]:
        summ = summary(bench.rows, peak)
        payload = {
            "env": env,
            "elapsed_s": bench.elapsed(),
            "configs": {f: [asdict(c) for c in cs] for f, cs in sweep.items()},
            "broken": bench.broken,
            "summary": summ,
            "epilogue": bench.epilogue,
            "results": bench.rows,
        }
        path.write_text(json.dumps(payload, indent=1))
        return summ

    for m in args.rows:
        for label, n, k in SHAPES:
            bench.shape(label, m, n, k, sweep, modes)
            save()
        if m in args.epilogue_rows:
            bench.epilogue_shape(m, list(sweep), modes)
            save()
    summ = save()
    table = markdown(summ, bench.epilogue, env)
    (args.out / "fp8_gemm_bench.md").write_text(table)
    log(f"\nwrote {path} ({bench.elapsed():.0f} s)\n")
    log(table)


if __name__ == "__main__":
    main()
