"""Every figure of the README's table, BENCHMARKS.md's summary tables and the docs' measured claims,
re-derived from the raw file it came from, so a figure cannot drift from its data.

A claim names the doc, a quote of it (one line, verbatim) holding the figure, the figure as printed, the raw
file under bench/results/ and the key that gives the number in it. The check passes when the quote is in
the doc and the number the key gives, scaled to the printed unit and rounded as printed, is the figure.

Keys:
- JSON: a dotted path; `[field=value,...]` picks the list element whose fields have those values; a number
  indexes a list. `A / B` is the ratio of two paths, `A - B` their difference; `PATH ~ REGEX` reads the
  number REGEX's group 1 finds in the string at PATH.
- Text (.log, .txt): `~ REGEX`, the number group 1 finds in the file (the first match).

A table marked with `<!-- figures: bench/claims.py -->` on the line before it is held whole: every
measured-looking number in it (a decimal, or a number with a unit: s, ms, min, x, %, dB, GB, GiB) must be
the figure of a claim whose quote sits in that table.

    python -m bench.claims            # checks every claim; exit status 1 and one line per failure
"""

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "bench/results"
MARKER = "<!-- figures: bench/claims.py -->"
# A number that reads as a measurement: a decimal, or a number followed by a unit; not a part of a name,
# a path, a date or a link's text (`Edit-2511`, `session14`, `2026-12-03`, `[2.1]`), a model's version, nor a
# target (`<= 0.40 s`, quoted from the issue that set it). Inline code is left out before the scan.
MEASURED = re.compile(
    r"(?<![\w.\-/\[])(?<!Image )(?<![<>]= )[-+]?\d+"
    r"(?:\.\d+(?![\d.])(?:\s?(?:s|ms|min|x|%|dB|GB|GiB)(?!\w))?|\s?(?:s|ms|min|x|%|dB|GB|GiB)(?!\w))"
)
NUMBER = re.compile(r"(?:(?<![\w.])[-+])?\d+(?:\.\d+)?")  # a sign only where it is not a hyphen


@dataclass(frozen=True)
class Claim:
    """`figure`, as printed inside `quote` in `doc`, is `(the number key gives in raw + offset) * scale`: a
    percentage of a fraction is scale 100, a change in percent offset -1 and scale 100, minutes scale 1/60."""

    doc: str
    quote: str
    figure: str
    raw: str
    key: str
    scale: float = 1.0
    offset: float = 0.0


def session(folder: str, name: str) -> str:
    return f"{RESULTS}/{folder}/{name}"


S3 = "2026-11-29-h200-session3"
S4 = "2026-12-01-h200-session4"
S7 = "2026-12-01-h200-session7"
S8 = "2026-12-01-h200-session8"
S11 = "2026-12-02-h200-session11"
S14 = "2026-12-03-h200-session14"
S15 = "2026-12-03-h200-session15"
S16 = "2026-12-04-h200-session16"
S17 = "2026-12-04-h200-session17"
S18 = "2026-12-04-h200-session18"
S19 = "2026-12-04-h200-session19"
S21 = "2026-12-06-h200-session21"
S22 = "2026-12-06-h100-session22"
CPU = "2026-12-03-cpu-avx512"
CACHE = "2026-12-03-cpu-cache"
SUITE22 = "2026-12-06-cpu-suite"
MINUTES = 1 / 60
PERCENT = 100.0

STEP_1024 = session(S3, "step_bench_1024.json")
T2I_CACHE = session(S14, "call1_cache_t2i_50.json")
LORA = session(S4, "lora_bench.json")
EDIT = session(S7, "call3_edit_bench.json")
START = session(S15, "call7_start_bench.json")
EDIT_INPAINT = session(S17, "call4_edit_inpaint_bench.json")
CONTROL = session(S16, "call3_control_bench.json")
CONTROL_INPAINT = session(S16, "call5_control_inpaint_bench.json")
LAYERED = session(S17, "call3_layered_bench.json")
QI21 = session(S7, "call2_qi21_bench.json")
NVFP4_STEPS = session(S22, "call1_nvfp4_step_bench.json")
NVFP4_MEMORY = session(S22, "call2_memory_bench_nvfp4.json")
NVFP4_RANDOM_QUALITY = session(S22, "call2_nvfp4_quality.json")
ROOFLINE = session(S22, "call6_roofline/roofline.md")  # bench/profile_step.py --tables-from, on the device
NVFP4_16 = "[budget_gib=16.0]"
NVFP4_QUALITY = "2026-12-06-cpu-quality-nvfp4"
NVFP4_OVER_BF16 = "[variant=nvfp4+graph,batch=1].median_ms / [variant=contract+graph,batch=1].median_ms"
TIMINGS = session(CPU, "cpu_timings.json")
TIMINGS_AVX2 = session(CPU, "cpu_timings_avx2_kernels.json")
TIMINGS_FP8 = session(CPU, "cpu_timings_fp8.json")
TIMINGS_FP8_AVX2 = session(CPU, "cpu_timings_fp8_avx2_kernels.json")
SUITE_BF16 = session(CPU, "suite_native_bf16.log")
MEANING = session("2026-12-01-cpu-meaning", "meaning.json")
MEANING_50 = session(CACHE, "meaning_steps50.json")
MEANING_20 = session(CACHE, "meaning_steps20.json")
DIVERSE = session(CACHE, "parity_diverse_fast_20_steps.json")
SMOKE = session(CACHE, "parity_smoke_fast_20_steps.json")
T2I_SCHEDULE = session(S14, "call4_cache_t2i_50_schedule_fast.json")
CACHE_16GIB = session(S15, "call4_cache_t2i_50_16gib.json")
CACHE_24GIB = session(S15, "call5_cache_t2i_50_24gib.json")
SUITE_SECONDS = r"~ passed.* in (\d+\.\d+)s"
FIRST_TOTAL = r"commands.first.stdout ~ total (\d+\.\d+) s"
FP8_TOTAL = r"commands.fp8-fused.stdout ~ total (\d+\.\d+) s"
STEP_RATIO = "[variant=diffusers,batch=2].median_ms / [variant=fp8-fused+graph,batch=2].median_ms"
QI21_SECONDS = "runs.fp8 t2i.seconds_per_image"
QI21_RATIO = "runs.diffusers t2i.seconds_per_image / runs.fp8 t2i.seconds_per_image"
ALWAYS_SKIPPED = r"runs[cache=always].skipped ~ skipped in (\d+) of"

README = "README.md"
README_CLAIMS: tuple[Claim, ...] = (
    # The first screen's table and the lines around it.
    Claim(README, "10.55 s per 50-step image", "10.55", T2I_CACHE, "runs[cache=off].s_per_image"),
    Claim(README, "10.55 s per 50-step image, 1.68x diffusers", "1.68", STEP_1024, STEP_RATIO),
    Claim(README, "Lightning-8 (CFG off) 0.93 s", "0.93", LORA, "lightning.lightning-8.seconds"),
    Claim(README, "19.27 s per 40-step edit", "19.27", EDIT, "full_cfg.seconds"),
    Claim(README, "1024x1024 image, 1.61x diffusers", "1.61", EDIT, "targets.speedup_vs_diffusers.value"),
    Claim(README, "6.47 s (30 of 50 steps)", "6.47", START, "per_image.img2img.seconds"),
    Claim(README, "6.47 s (30 of 50 steps)", "30", START, "per_image.img2img.steps_run"),
    Claim(README, "(30 of 50 steps), 1.70x diffusers", "1.70", START, "per_step_ms.img2img.speedup"),
    Claim(README, "17.89 s (30 of 50 steps)", "17.89", EDIT_INPAINT, "per_image.inpainting_edit.seconds"),
    Claim(README, "17.89 s (30 of 50 steps)", "30", EDIT_INPAINT, "per_image.inpainting_edit.steps_run"),
    Claim(README, "17.89 s (30 of 50 steps), 1.51x", "1.51", EDIT_INPAINT, "per_step_ms.speedup"),
    Claim(README, "one map 11.66 s, 1.60x", "11.66", CONTROL, "per_image.one_map.seconds"),
    Claim(README, "one map 11.66 s, 1.60x", "1.60", CONTROL, "per_step_ms.speedup"),
    Claim(README, "inpainting 11.89 s, 1.59x", "11.89", CONTROL_INPAINT, "per_image.inpaint.seconds"),
    Claim(README, "inpainting 11.89 s, 1.59x", "1.59", CONTROL_INPAINT, "per_step_ms.speedup"),
    Claim(README, "29.78 s, 1.52x diffusers", "29.78", LAYERED, "per_image.seconds"),
    Claim(README, "29.78 s, 1.52x diffusers", "1.52", LAYERED, "per_step_ms.speedup"),
    Claim(README, "3.50 s per 40-step image", "3.50", QI21, QI21_SECONDS),
    Claim(README, "(CFG off), 1.70x diffusers; Turbo", "1.70", QI21, QI21_RATIO),
    Claim(README, "Turbo-8 0.84 s", "0.84", QI21, "runs.fp8 turbo-8.seconds_per_image"),
    Claim(README, "Command 1 took 11 s", "11", TIMINGS, "commands.first.median_s"),
    Claim(README, "1.7 s of it generating", "1.7", TIMINGS, FIRST_TOTAL),
    Claim(README, "Command 2 took 14 minutes", "14", SUITE_BF16, SUITE_SECONDS, MINUTES),
    Claim(
        README,
        "and 13 with torch held",
        "13",
        session(SUITE22, "suite_avx2_emulated.log"),
        SUITE_SECONDS,
        MINUTES,
    ),
    Claim(README, "(1.23x BF16's step)", "1.23", NVFP4_STEPS, NVFP4_OVER_BF16),
    Claim(
        README, "on the device (peak 15.1 GiB)", "15.1", NVFP4_MEMORY, f"budgets{NVFP4_16}.peak_reserved_gib"
    ),
)

TESTING, CLI, FP8, CACHING, MEMORY = (
    "docs/testing.md",
    "docs/cli.md",
    "docs/fp8.md",
    "docs/caching.md",
    "docs/memory.md",
)
PLANS = session("2026-12-05-cpu-claims", "plans_info.txt")
NVFP4_PAGE = "docs/nvfp4.md"
PAGE_CLAIMS: tuple[Claim, ...] = (
    *(
        Claim(NVFP4_PAGE, quote, figure, NVFP4_STEPS, f"[variant={variant},batch=1].median_ms")
        for quote, figure, variant in (
            ("a 1024x1024 step takes 156.0 ms", "156.0", "nvfp4+graph"),
            ("against BF16's 127.1 ms and FP8's 103.6 ms", "127.1", "contract+graph"),
            ("against BF16's 127.1 ms and FP8's 103.6 ms", "103.6", "fp8-fused+graph"),
        )
    ),
    *(
        Claim(NVFP4_PAGE, quote, figure, session(folder, f"{option}.json"), "summary.all.psnr_db.median")
        for quote, figure, folder, option in (
            ("BF16 is 16.6 dB with the default rules", "16.6", NVFP4_QUALITY, "nvfp4"),
            ("and 14.3 dB with every block", "14.3", NVFP4_QUALITY, "nvfp4-every-block"),
            ("4-bit, FP8's 26.8 dB", "26.8", "2026-12-05-cpu-quality", "fp8"),
        )
    ),
    Claim(
        NVFP4_PAGE,
        "none streamed, peak 15.1 GiB reserved",
        "15.1",
        NVFP4_MEMORY,
        f"budgets{NVFP4_16}.peak_reserved_gib",
    ),
    *(
        Claim(NVFP4_PAGE, quote, figure, NVFP4_RANDOM_QUALITY, f"rows.{row}.psnr_db.median")
        for quote, figure, row in (
            ("NVFP4 50.09 dB (every block 50.06), FP8 50.40 dB", "50.09", "nvfp4"),
            ("NVFP4 50.09 dB (every block 50.06), FP8 50.40 dB", "50.06", "nvfp4-every-block"),
            ("NVFP4 50.09 dB (every block 50.06), FP8 50.40 dB", "50.40", "fp8"),
        )
    ),
    Claim(TESTING, "VAE BF16 | 14 min", "14", SUITE_BF16, SUITE_SECONDS, MINUTES),
    Claim(
        TESTING, "FP32 forced: 7 min", "7", session(CPU, "cpu_dtype_forced_fp32.log"), SUITE_SECONDS, MINUTES
    ),
    Claim(
        TESTING,
        "FP32 VAE | 17 min",
        "17",
        session(CPU, "suite_avx2_kernels_forced_fp32.log"),
        SUITE_SECONDS,
        MINUTES,
    ),
    Claim(
        TESTING,
        "BF16 forced: 13 min",
        "13",
        session(CPU, "cpu_dtype_avx2_kernels_forced_bf16.log"),
        SUITE_SECONDS,
        MINUTES,
    ),
    Claim(
        TESTING,
        "kind picks (`QWEN_IMAGE_CPU_DTYPE=fp32`) | 13 min",
        "13",
        session(SUITE22, "suite_avx2_emulated.log"),
        SUITE_SECONDS,
        MINUTES,
    ),
    Claim(
        TESTING,
        "BF16 forced: 9 min",
        "9",
        session(SUITE22, "cpu_dtype_avx2_emulated_forced_bf16.log"),
        SUITE_SECONDS,
        MINUTES,
    ),
    Claim(CLI, "1.7 s to generate, 11 s for the whole", "1.7", TIMINGS, FIRST_TOTAL),
    Claim(CLI, "1.7 s to generate, 11 s for the whole", "11", TIMINGS, "commands.first.median_s"),
    Claim(CLI, "as on the other kind, 1.6 s and 12 s", "1.6", TIMINGS_AVX2, FIRST_TOTAL),
    Claim(CLI, "as on the other kind, 1.6 s and 12 s", "12", TIMINGS_AVX2, "commands.first.median_s"),
    Claim(CLI, "96% (English) and 95% (Chinese)", "96", MEANING, "accuracy.en.colour_position", PERCENT),
    Claim(CLI, "96% (English) and 95% (Chinese)", "95", MEANING, "accuracy.zh.colour_position", PERCENT),
    Claim(FP8, "cores 21 s with AVX-512 BF16, 33 s with", "21", TIMINGS, "commands.quantize.median_s"),
    Claim(FP8, "cores 21 s with AVX-512 BF16, 33 s with", "33", TIMINGS_AVX2, "commands.quantize.median_s"),
    Claim(
        FP8, "(each generate 10 s there in all, 1.9 s of it", "10", TIMINGS_FP8, "commands.fp8-fused.median_s"
    ),
    Claim(FP8, "(each generate 10 s there in all, 1.9 s of it", "1.9", TIMINGS_FP8, FP8_TOTAL),
    Claim(FP8, "11 s and 3.6 s with the AVX2", "11", TIMINGS_FP8_AVX2, "commands.fp8-fused.median_s"),
    Claim(FP8, "11 s and 3.6 s with the AVX2", "3.6", TIMINGS_FP8_AVX2, FP8_TOTAL),
    Claim(CACHING, "`fast` skipped 29.5 of 50 steps", "29.5", MEANING_50, "cache.fast.skipped_steps.mean"),
    Claim(CACHING, "on average (28 to 30)", "28", MEANING_50, "cache.fast.skipped_steps.min"),
    Claim(CACHING, "on average (28 to 30)", "30", MEANING_50, "cache.fast.skipped_steps.max"),
    Claim(CACHING, "its worst image 27.7 dB", "27.7", MEANING_50, "cache.fast.versus_exact.psnr_db.min"),
    Claim(CACHING, "(median 38.4 dB)", "38.4", MEANING_50, "cache.fast.versus_exact.psnr_db.median"),
    Claim(CACHING, "on the 47 `diverse` prompts", "47", DIVERSE, "summary.pairs"),
    Claim(CACHING, "median was 31.4 dB", "31.4", DIVERSE, "summary.metrics.psnr_db.median"),
    Claim(CACHING, "the worst 16.1 dB", "16.1", DIVERSE, "summary.metrics.psnr_db.min"),
    Claim(CACHING, "on the 5 `smoke` prompts", "5", SMOKE, "summary.pairs"),
    Claim(CACHING, "the worst 17.05 dB", "17.05", SMOKE, "summary.metrics.psnr_db.min"),
    Claim(CACHING, "took 4.46 s on one H200", "4.46", T2I_SCHEDULE, "runs[cache=always].s_per_image"),
    Claim(CACHING, "instead of 10.48 s exact", "10.48", T2I_SCHEDULE, "runs[cache=off].s_per_image"),
    Claim(CACHING, "skips, 14.97 s instead of", "14.97", CACHE_16GIB, "runs[cache=always].s_per_image"),
    Claim(CACHING, "32.58 s. These are", "32.58", CACHE_16GIB, "runs[cache=off].s_per_image"),
    Claim(CACHING, "30 of 50 per branch (5 warm-up", "30", T2I_SCHEDULE, ALWAYS_SKIPPED),
    # The planner's table (its estimates, printed by `qwen-image info --gpu-memory`).
    Claim(MEMORY, "| 56 GiB | everything resident", "56", PLANS, r"~ plan for (56)\.0 GiB"),
    Claim(MEMORY, "| 48 / 40 GiB | text", "40", PLANS, r"~ plan for (40)\.0 GiB"),
    Claim(
        MEMORY,
        "offloaded | 15.2 GB per request",
        "15.2",
        PLANS,
        r"~ plan for 40\.0 GiB[^$]*?, (\d+\.\d+) GB per request",
    ),
    Claim(MEMORY, "| 32 GiB | text", "32", PLANS, r"~ plan for (32)\.0 GiB"),
    Claim(
        MEMORY,
        "decoding | 18.7 GB per request",
        "18.7",
        PLANS,
        r"~ plan for 32\.0 GiB[^$]*?, (\d+\.\d+) GB per request",
    ),
    Claim(MEMORY, "| 24 GiB | 18 of 60", "24", PLANS, r"~ plan for (24)\.0 GiB"),
    Claim(MEMORY, "| 24 GiB | 18 of 60", "18", PLANS, r"~ plan for 24\.0 GiB[^$]*?; (\d+) streamed from"),
    Claim(
        MEMORY, "| 17.7 GB per step |", "17.7", PLANS, r"~ plan for 24\.0 GiB[^$]*?: (\d+\.\d+) GB per step"
    ),
    Claim(MEMORY, "| 16 GiB | 34 of 60", "16", PLANS, r"~ plan for (16)\.0 GiB"),
    Claim(MEMORY, "| 16 GiB | 34 of 60", "34", PLANS, r"~ plan for 16\.0 GiB[^$]*?; (\d+) streamed from"),
    Claim(
        MEMORY, "| 33.4 GB per step |", "33.4", PLANS, r"~ plan for 16\.0 GiB[^$]*?: (\d+\.\d+) GB per step"
    ),
)

BENCH = "BENCHMARKS.md"
L8_CACHE = session(S14, "call1_cache_lightning_8.json")
L4_CACHE = session(S14, "call1_cache_lightning_4.json")
QI21_CACHE = session(S14, "call2_cache_qi21_40.json")
EDIT_CACHE = session(S14, "call3_cache_edit_40.json")
L4_NOW, L8_NOW = (
    session(S19, "call3_request_profile_lightning-4_1024.json"),
    session(S19, "call3_request_profile_lightning-8_1024.json"),
)
L4_S18, L8_S18 = (
    session(S18, "call2_request_profile_lightning-4_1024.json"),
    session(S18, "call2_request_profile_lightning-8_1024.json"),
)
SERVE_1024, SERVE_1024_BEFORE = (
    session(S19, "call5_server_load_1024.json"),
    session(S19, "call4_server_load_1024.json"),
)
SERVE_512 = session(S19, "call4_server_load_512.json")
MEMORY_24 = session(S8, "call2_memory_bench.json")
MEMORY_FP8MOD = session(S11, "call5_memory_bench_fp8mod.json")
COSTS = session("2026-12-05-cpu-claims", "response_costs.json")
OFF, ALWAYS, NEVER = (
    "runs[cache=off].s_per_image",
    "runs[cache=always].s_per_image",
    "runs[cache=never].s_per_image",
)
FAST, FASTER = "runs[cache=fast].s_per_image", "runs[cache=faster].s_per_image"
SPEEDUP, CHANGE = f"{OFF} / {ALWAYS}", f"{NEVER} / {OFF}"
PAIRS = "workloads.1024.http_overhead_paired"
BATCHING = "workloads.512.batching_{}.by_clients.16"


def bench_row(quote: str, raw: str, figures: dict[str, str]) -> tuple[Claim, ...]:
    """Claims for a row or line of BENCHMARKS.md: each figure of `quote` and the key giving it in `raw`."""
    return tuple(Claim(BENCH, quote, figure, raw, key) for figure, key in figures.items())


def quality_row(quote: str, raw: str, preset: str | None, figures: dict[str, str]) -> tuple[Claim, ...]:
    """Claims for one row of the cache quality table: accuracy fractions as percentages, the rest as is."""
    base = f"cache.{preset}." if preset else ""
    return tuple(
        Claim(BENCH, quote, figure, raw, base + key, PERCENT if key.startswith("accuracy") else 1.0)
        for figure, key in figures.items()
    )


FAST_50 = "`fast` | 29.5 (28-30) | **27.70** / 38.37 | 0.9747 / 0.9955 | 90% | 40% |"
FASTER_50 = "`faster` | 35.0 (34-35) | **26.17** / 33.64 | 0.9633 / 0.9901 | 90% | 40% |"
FAST_20 = "`fast` | 6.1 (5-7) | **23.17** / 37.33 | 0.9524 / 0.9940 | 95% | 41% |"
FASTER_20 = "`faster` | 10.0 (9-11) | **23.44** / 31.46 | 0.9487 / 0.9824 | 96% | 41% |"
PRESET_FIGURES = (
    ("skipped_steps.mean", "skipped_steps.min", "skipped_steps.max"),
    ("versus_exact.psnr_db.min", "versus_exact.psnr_db.median"),
    ("versus_exact.ssim.min", "versus_exact.ssim.median"),
    ("accuracy.all.colour_position", "accuracy.all.count"),
)


def preset_row(quote: str, raw: str, preset: str) -> tuple[Claim, ...]:
    """The row of `preset` in the quality table: its figures in the order the columns print them."""
    figures = [n.group(0) for n in NUMBER.finditer(quote)]
    keys = [key for group in PRESET_FIGURES for key in group]
    return quality_row(quote, raw, preset, dict(zip(figures, keys, strict=True)))


NVFP4_QUOTE = "| 156.0 ms against 127.1 ms and 103.6 ms |"
BENCH_CLAIMS: tuple[Claim, ...] = (
    # The summary table.
    *(
        Claim(
            BENCH, "| 60 of 60, 0.00 GB, 15.1 GiB |", figure, NVFP4_MEMORY, f"budgets{NVFP4_16}.{key}", scale
        )
        for figure, key, scale in (
            ("0.00", "bytes_per_step", 1e-9),
            ("15.1", "peak_reserved_gib", 1.0),
        )
    ),
    *(
        Claim(BENCH, NVFP4_QUOTE, figure, NVFP4_STEPS, f"[variant={variant},batch=1].median_ms")
        for figure, variant in (
            ("156.0", "nvfp4+graph"),
            ("127.1", "contract+graph"),
            ("103.6", "fp8-fused+graph"),
        )
    ),
    *(
        Claim(BENCH, quote, figure, ROOFLINE, rf"~ \| {request} \|(?: [^|]+ \|){{4}} (\d+\.\d+)x \|")
        for quote, figure, request in (
            ("T2I 1.54x", "1.54", "t2i-cfg"),
            ("Lightning-4 1.51x", "1.51", "lightning4"),
            ("Edit-2511 1.64x", "1.64", "edit2511-cfg"),
            ("Qwen-Image 2.1 1.51x", "1.51", "qi21-cfg"),
        )
    ),
    Claim(BENCH, "| 10.55 s |", "10.55", T2I_CACHE, OFF),
    Claim(
        BENCH,
        "197.7 ms against 331.7 ms (1.68x)",
        "197.7",
        STEP_1024,
        "[variant=fp8-fused+graph,batch=2].median_ms",
    ),
    Claim(
        BENCH,
        "197.7 ms against 331.7 ms (1.68x)",
        "331.7",
        STEP_1024,
        "[variant=diffusers,batch=2].median_ms",
    ),
    Claim(BENCH, "197.7 ms against 331.7 ms (1.68x)", "1.68", STEP_1024, STEP_RATIO),
    Claim(BENCH, "| 0.930 s / 0.514 s |", "0.930", LORA, "lightning.lightning-8.seconds"),
    Claim(BENCH, "| 0.930 s / 0.514 s |", "0.514", LORA, "lightning.lightning-4.seconds"),
    Claim(BENCH, "| 1.17x (target <= 1.10x: missed) |", "1.17", LORA, "targets.branch_over_merged.value"),
    Claim(BENCH, "| 4.46 s per 50-step CFG image (2.35x) |", "4.46", T2I_SCHEDULE, ALWAYS),
    Claim(BENCH, "| 4.46 s per 50-step CFG image (2.35x) |", "2.35", T2I_SCHEDULE, SPEEDUP),
    Claim(BENCH, "| 29.5 of 50 steps skipped; PSNR", "29.5", MEANING_50, "cache.fast.skipped_steps.mean"),
    Claim(
        BENCH,
        "PSNR worst 27.70 dB, median 38.37 dB |",
        "27.70",
        MEANING_50,
        "cache.fast.versus_exact.psnr_db.min",
    ),
    Claim(
        BENCH,
        "PSNR worst 27.70 dB, median 38.37 dB |",
        "38.37",
        MEANING_50,
        "cache.fast.versus_exact.psnr_db.median",
    ),
    Claim(
        BENCH,
        "(resident 10.43 s) | 18.43 s (1.77x) |",
        "10.43",
        MEMORY_24,
        "budgets[budget_gib=None].cfg_50.seconds_50_steps",
    ),
    Claim(
        BENCH,
        "(resident 10.43 s) | 18.43 s (1.77x) |",
        "18.43",
        MEMORY_24,
        "budgets[budget_gib=24.0].cfg_50.seconds_50_steps",
    ),
    Claim(
        BENCH,
        "(resident 10.43 s) | 18.43 s (1.77x) |",
        "1.77",
        MEMORY_24,
        "budgets[budget_gib=24.0].x_uncapped_50_steps",
    ),
    Claim(
        BENCH,
        "(resident 11.06 s) | 12.03 s (1.09x) |",
        "11.06",
        MEMORY_FP8MOD,
        "budgets[budget_gib=None].cfg_50.seconds_50_steps",
    ),
    Claim(
        BENCH,
        "(resident 11.06 s) | 12.03 s (1.09x) |",
        "12.03",
        MEMORY_FP8MOD,
        "budgets[budget_gib=24.0].cfg_50.seconds_50_steps",
    ),
    Claim(
        BENCH,
        "(resident 11.06 s) | 12.03 s (1.09x) |",
        "1.09",
        MEMORY_FP8MOD,
        "budgets[budget_gib=24.0].x_uncapped_50_steps",
    ),
    Claim(BENCH, "| 475.5 ms (1.61x diffusers) |", "475.5", EDIT, "per_step_ms.ours_fp8_fused_graph"),
    Claim(BENCH, "| 475.5 ms (1.61x diffusers) |", "1.61", EDIT, "targets.speedup_vs_diffusers.value"),
    Claim(BENCH, "| 3.50 s (1.70x diffusers per image) |", "3.50", QI21, QI21_SECONDS),
    Claim(BENCH, "| 3.50 s (1.70x diffusers per image) |", "1.70", QI21, QI21_RATIO),
    Claim(BENCH, "| 15.0 ms (the run before: 21.9 ms) |", "15.0", SERVE_1024, f"{PAIRS}.median_ms"),
    Claim(BENCH, "| 15.0 ms (the run before: 21.9 ms) |", "21.9", SERVE_1024_BEFORE, f"{PAIRS}.median_ms"),
    Claim(BENCH, "16 clients, one run | 1.34x |", "1.34", SERVE_512, "workloads.512.speedup_by_clients.16"),
    # Step cache: the quality table (the trained embedded default, CPU).
    *quality_row(
        "| exact | exact | 90% | 50% |",
        MEANING_50,
        None,
        {"90": "accuracy.all.colour_position", "50": "accuracy.all.count"},
    ),
    *preset_row(FAST_50, MEANING_50, "fast"),
    *preset_row(FASTER_50, MEANING_50, "faster"),
    *quality_row(
        "| exact | exact | 95% | 41% |",
        MEANING_20,
        None,
        {"95": "accuracy.all.colour_position", "41": "accuracy.all.count"},
    ),
    *preset_row(FAST_20, MEANING_20, "fast"),
    *preset_row(FASTER_20, MEANING_20, "faster"),
    # Step cache: the speed table (fixed schedules, one H200).
    *bench_row("| 10.55 (10.48 in call 4)", T2I_CACHE, {"10.55": OFF}),
    *bench_row("| 10.55 (10.48 in call 4)", T2I_SCHEDULE, {"10.48": OFF}),
    *bench_row("| 10.58 (+0.3%) |", T2I_CACHE, {"10.58": NEVER}),
    Claim(BENCH, "| 10.58 (+0.3%) |", "+0.3", T2I_CACHE, CHANGE, PERCENT, -1.0),
    *bench_row("| 10.57 / 10.55, 0 skipped", T2I_CACHE, {"10.57": FAST, "10.55": FASTER}),
    Claim(
        BENCH,
        "near `fast`'s 29.5** | **4.46** | **2.35x** |",
        "29.5",
        MEANING_50,
        "cache.fast.skipped_steps.mean",
    ),
    *bench_row(
        "near `fast`'s 29.5** | **4.46** | **2.35x** |", T2I_SCHEDULE, {"4.46": ALWAYS, "2.35": SPEEDUP}
    ),
    Claim(
        BENCH, "near `faster`'s 35.0 | 3.26 | 3.24x |", "35.0", MEANING_50, "cache.faster.skipped_steps.mean"
    ),
    *bench_row("near `faster`'s 35.0 | 3.26 | 3.24x |", T2I_CACHE, {"3.26": ALWAYS, "3.24": SPEEDUP}),
    *bench_row(
        "| 0.934 | | 0.941 / 0.947, 0 skipped | 4 of 8 (W 2, N 2) | 0.531 | 1.76x |",
        L8_CACHE,
        {"0.934": OFF, "0.941": FAST, "0.947": FASTER, "0.531": ALWAYS, "1.76": SPEEDUP},
    ),
    *bench_row("(CFG off) | 0.561 | |", L4_CACHE, {"0.561": OFF}),
    *bench_row("| 0.561 / 0.555, 0 skipped", L4_CACHE, {"0.561": FAST, "0.555": FASTER}),
    *bench_row("| 0.354 | 1.58x |", L4_CACHE, {"0.354": ALWAYS, "1.58": SPEEDUP}),
    *bench_row(
        "| 3.514 | 3.547 (+0.9%) | 3.482 / 3.508, 0 skipped |",
        QI21_CACHE,
        {"3.514": OFF, "3.547": NEVER, "3.482": FAST, "3.508": FASTER},
    ),
    Claim(
        BENCH,
        "| 3.514 | 3.547 (+0.9%) | 3.482 / 3.508, 0 skipped |",
        "+0.9",
        QI21_CACHE,
        CHANGE,
        PERCENT,
        -1.0,
    ),
    *bench_row("| 1.183 | 2.97x |", QI21_CACHE, {"1.183": ALWAYS, "2.97": SPEEDUP}),
    *bench_row(
        "| 19.67 | 19.73 (+0.3%) | 19.65 / 19.75, 0 skipped |",
        EDIT_CACHE,
        {"19.67": OFF, "19.73": NEVER, "19.65": FAST, "19.75": FASTER},
    ),
    Claim(
        BENCH,
        "| 19.67 | 19.73 (+0.3%) | 19.65 / 19.75, 0 skipped |",
        "+0.3",
        EDIT_CACHE,
        CHANGE,
        PERCENT,
        -1.0,
    ),
    *bench_row("| 6.06 | 3.25x |", EDIT_CACHE, {"6.06": ALWAYS, "3.25": SPEEDUP}),
    # Step cache under memory plans (session 15).
    *bench_row("| 24 GiB | 42 of 60 blocks resident", CACHE_24GIB, {"24": "gpu_memory ~ (\\d+)GiB"}),
    *bench_row(
        "18 streamed: 8.83 GB per call | 17.66 | **9.10** | 1.94x | 22.37 GiB |",
        CACHE_24GIB,
        {
            "8.83": r"plan.2 ~ \((\d+\.\d+) GB per call\)",
            "17.66": OFF,
            "9.10": ALWAYS,
            "1.94": SPEEDUP,
            "22.37": "peak_reserved_gib",
        },
    ),
    *bench_row("| 16 GiB | 25 resident", CACHE_16GIB, {"16": "gpu_memory ~ (\\d+)GiB"}),
    *bench_row(
        "35 streamed: 17.18 GB per call | 32.58 | **14.97** | 2.18x | 14.59 GiB |",
        CACHE_16GIB,
        {
            "17.18": r"plan.2 ~ \((\d+\.\d+) GB per call\)",
            "32.58": OFF,
            "14.97": ALWAYS,
            "2.18": SPEEDUP,
            "14.59": "peak_reserved_gib",
        },
    ),
    # The latency targets, now (session 19's table).
    Claim(
        BENCH, "| 0.522 s (session 18); 0.550 s in call 3 | **0.500 s**", "0.522", L4_S18, "stages_s.total"
    ),
    Claim(
        BENCH, "| 0.522 s (session 18); 0.550 s in call 3 | **0.500 s**", "0.550", L4_NOW, "stages_s.total"
    ),
    Claim(
        BENCH,
        "| 0.522 s (session 18); 0.550 s in call 3 | **0.500 s**",
        "0.500",
        L4_NOW,
        "fast_decode.stages_s.total",
    ),
    Claim(
        BENCH, "| 0.935 s (session 18); 0.946 s in call 3 | **0.927 s**", "0.935", L8_S18, "stages_s.total"
    ),
    Claim(
        BENCH, "| 0.935 s (session 18); 0.946 s in call 3 | **0.927 s**", "0.946", L8_NOW, "stages_s.total"
    ),
    Claim(
        BENCH,
        "| 0.935 s (session 18); 0.946 s in call 3 | **0.927 s**",
        "0.927",
        L8_NOW,
        "fast_decode.stages_s.total",
    ),
    Claim(BENCH, "| 1.17x (session 4; not re-run) |", "1.17", LORA, "targets.branch_over_merged.value"),
    Claim(
        BENCH,
        "| 3.47 / 0.83 s (session 18) |",
        "3.47",
        session(S18, "call2_request_profile_qi21-40-steps_1024.json"),
        "stages_s.total",
    ),
    Claim(
        BENCH,
        "| 3.47 / 0.83 s (session 18) |",
        "0.83",
        session(S18, "call2_request_profile_qi21-turbo-8_1024.json"),
        "stages_s.total",
    ),
    Claim(BENCH, "| 1.173 s (session 7; not re-run) |", "1.173", EDIT, "lightning4.seconds"),
    *bench_row(
        "**15.0 ms** in one run (call 5: median of 40 served / direct pairs, p10 -0.5, p90 27.7)",
        SERVE_1024,
        {
            "15.0": f"{PAIRS}.median_ms",
            "40": f"{PAIRS}.pairs",
            "-0.5": f"{PAIRS}.p10_ms",
            "27.7": f"{PAIRS}.p90_ms",
        },
    ),
    *bench_row(
        "21.9 ms in call 4 (30 pairs, p10 10.6, p90 36.7; before pybase64)",
        SERVE_1024_BEFORE,
        {
            "21.9": f"{PAIRS}.median_ms",
            "30": f"{PAIRS}.pairs",
            "10.6": f"{PAIRS}.p10_ms",
            "36.7": f"{PAIRS}.p90_ms",
        },
    ),
    *bench_row(
        "**1.34x** in one run (96 requests, 7.4 per batch; 3.17 -> 4.26 images/s)",
        SERVE_512,
        {
            "1.34": "workloads.512.speedup_by_clients.16",
            "96": BATCHING.format("on") + ".requests",
            "7.4": BATCHING.format("on") + ".mean_requests_per_batch",
            "3.17": BATCHING.format("off") + ".images_per_s",
            "4.26": BATCHING.format("on") + ".images_per_s",
        },
    ),
    # Section titles.
    *bench_row(
        "4.46 s per 50-step CFG image skipping 30 of 50 steps (2.35x)",
        T2I_SCHEDULE,
        {"4.46": ALWAYS, "30": ALWAYS_SKIPPED, "2.35": SPEEDUP},
    ),
    *bench_row("fixed schedule (speed only): 24 GiB 1.94x, 16 GiB 2.18x", CACHE_24GIB, {"1.94": SPEEDUP}),
    *bench_row("fixed schedule (speed only): 24 GiB 1.94x, 16 GiB 2.18x", CACHE_16GIB, {"2.18": SPEEDUP}),
    *bench_row(
        "30 of 50 steps in 17.9 s, 1.51x diffusers per step",
        EDIT_INPAINT,
        {
            "30": "per_image.inpainting_edit.steps_run",
            "17.9": "per_image.inpainting_edit.seconds",
            "1.51": "per_step_ms.speedup",
        },
    ),
    *bench_row(
        "4 layers at 640x640 in 29.8 s, 1.52x diffusers per step",
        LAYERED,
        {"4": "layers", "29.8": "per_image.seconds", "1.52": "per_step_ms.speedup"},
    ),
    *bench_row("one map adds 22 ms per CFG step, 1.60x diffusers", CONTROL, {"1.60": "per_step_ms.speedup"}),
    Claim(
        BENCH,
        "one map adds 22 ms per CFG step, 1.60x diffusers",
        "22",
        CONTROL,
        "per_image.one_map.ms_per_step - per_image.text_to_image.ms_per_step",
    ),
    *bench_row(
        "costs what a text-to-image step costs, 1.70x diffusers",
        START,
        {"1.70": "per_step_ms.img2img.speedup"},
    ),
    Claim(
        BENCH,
        "batching pays 1.16-1.21x at 512x512",
        "1.16",
        session("2026-12-02-h200-session10", "call2_server_load.json"),
        "workloads.512.speedup_by_clients.16",
    ),
    Claim(
        BENCH,
        "batching pays 1.16-1.21x at 512x512",
        "1.21",
        session("2026-12-02-h200-session10", "call2_server_load.json"),
        "workloads.512.speedup_by_clients.40",
    ),
    # What a response costs on a CPU (measured for issue 51: these had no raw file).
    Claim(BENCH, "noise PNG of 3.1 MB", "3.1", COSTS, "png_bytes", 1e-6),
    Claim(BENCH, "server does 17.3 / 11.3 ms (6.1 ms", "17.3", COSTS, "ms.png_write.median"),
    Claim(BENCH, "server does 17.3 / 11.3 ms (6.1 ms", "11.3", COSTS, "ms.png_write.min"),
    Claim(
        BENCH,
        "server does 17.3 / 11.3 ms (6.1 ms",
        "6.1",
        SERVE_1024,
        "workloads.1024.direct.encode_s",
        1000.0,
    ),
    Claim(BENCH, "its base64 8.9 / 4.9 ms by the standard", "8.9", COSTS, "ms.base64_stdlib.median"),
    Claim(BENCH, "its base64 8.9 / 4.9 ms by the standard", "4.9", COSTS, "ms.base64_stdlib.min"),
    Claim(BENCH, "library and 0.09 ms by pybase64", "0.09", COSTS, "ms.base64_pybase64.median"),
    Claim(BENCH, "library and 0.09 ms by pybase64", "0.09", COSTS, "ms.base64_pybase64.min"),
    Claim(BENCH, "the JSON body 1.6 ms by pydantic-core", "1.6", COSTS, "ms.json_pydantic_core.median"),
    Claim(BENCH, "the JSON body 1.6 ms by pydantic-core", "1.6", COSTS, "ms.json_pydantic_core.min"),
    Claim(BENCH, "against 11.9 / 10.9 ms", "11.9", COSTS, "ms.json_dumps.median"),
    Claim(BENCH, "against 11.9 / 10.9 ms", "10.9", COSTS, "ms.json_dumps.min"),
)

CLAIMS = README_CLAIMS + PAGE_CLAIMS + BENCH_CLAIMS


@cache
def load(raw: str) -> Any:
    """A raw file: parsed JSON, or the text of a log."""
    text = (ROOT / raw).read_text(encoding="utf-8")
    return json.loads(text) if raw.endswith(".json") else text


def select(items: list[Any], conditions: str) -> Any:
    """The one element of `items` whose fields equal `conditions` (`field=value,...`)."""
    wanted = dict(part.split("=", 1) for part in conditions.split(","))
    found = [item for item in items if all(str(item.get(k)) == v for k, v in wanted.items())]
    if len(found) != 1:
        raise KeyError(f"[{conditions}] matches {len(found)} elements")
    return found[0]


def at(data: Any, path: str) -> Any:
    """The value at a dotted `path` of `data` (see the module's docstring)."""
    for part in re.findall(r"\[[^\]]*\]|[^.\[]+", path):
        if part.startswith("["):
            data = select(data, part[1:-1])
        elif isinstance(data, list):
            data = data[int(part)]
        else:
            data = data[part]
    return data


def number_in(text: str, pattern: str) -> float:
    found = re.search(pattern, text)
    if found is None:
        raise KeyError(f"no match for {pattern!r}")
    return float(found.group(1))


def derive(data: Any, key: str) -> float:
    """The number `key` gives in a loaded raw file."""
    if " / " in key:
        numerator, denominator = key.split(" / ")
        return derive(data, numerator) / derive(data, denominator)
    if " - " in key:
        minuend, subtrahend = key.split(" - ")
        return derive(data, minuend) - derive(data, subtrahend)
    if key.startswith("~ "):
        return number_in(data, key[2:])
    path, _, pattern = key.partition(" ~ ")
    value = at(data, path)
    return number_in(value, pattern) if pattern else float(value)


def printed(value: float, figure: str) -> str:
    """`value` rounded as `figure` is printed (its decimals and sign)."""
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    text = f"{value:.{decimals}f}"
    return f"+{text}" if figure.startswith("+") and value >= 0 else text


def figure_offset(claim: Claim) -> int | None:
    """Where the figure starts in the quote: the one number of the quote printed as the figure, or None."""
    found = [
        m.start() for m in NUMBER.finditer(claim.quote) if m.group(0).lstrip("+") == claim.figure.lstrip("+")
    ]
    return found[0] if len(found) == 1 and NUMBER.fullmatch(claim.figure) else None


def check(claim: Claim) -> str | None:
    """Why `claim` fails, or None."""
    where = f"{claim.doc}: {claim.quote!r}"
    if figure_offset(claim) is None:
        return f"{where}: the figure {claim.figure!r} is not exactly one number of the quote"
    if claim.quote not in doc_text(claim.doc):
        return f"{where}: not in the doc"
    if not claim.raw.startswith(f"{RESULTS}/"):
        return f"{where}: raw file {claim.raw} is not under {RESULTS}/"
    try:
        value = (derive(load(claim.raw), claim.key) + claim.offset) * claim.scale
    except (OSError, KeyError, IndexError, ValueError, TypeError) as error:
        return f"{where}: {claim.raw} {claim.key!r}: {error!r}"
    if printed(value, claim.figure) != claim.figure:
        return f"{where}: prints {claim.figure}, {claim.raw} gives {value!r} ({claim.key})"
    return None


@cache
def doc_text(doc: str) -> str:
    return (ROOT / doc).read_text(encoding="utf-8")


def marked_tables(text: str) -> list[tuple[int, int]]:
    """(start, end) offsets of each table that follows the marker line."""
    tables = []
    for found in re.finditer(re.escape(MARKER) + r"\n((?:\|.*\n?)+)", text):
        tables.append((found.start(1), found.end(1)))
    return tables


def without_code(text: str) -> str:
    """`text` with its inline code spans blanked (offsets kept): a number in code is a setting."""
    return re.sub(r"`[^`\n]*`", lambda code: " " * len(code.group(0)), text)


def uncovered(doc: str, claims: tuple[Claim, ...]) -> list[str]:
    """Measured-looking numbers in `doc`'s marked tables that no claim's figure covers."""
    text = doc_text(doc)
    covered: set[int] = set()
    for claim in claims:
        if claim.doc != doc:
            continue
        offset = figure_offset(claim)
        if offset is None:
            continue
        for found in re.finditer(re.escape(claim.quote), text):
            covered.add(found.start() + offset)
    missing = []
    scanned = without_code(text)
    for start, end in marked_tables(text):
        for number in MEASURED.finditer(scanned, start, end):
            if number.start() not in covered:
                line = text[text.rfind("\n", 0, number.start()) + 1 : text.find("\n", number.start())]
                missing.append(f"{doc}: {number.group(0)!r} has no claim (in {line[:80]!r})")
    return missing


def marked_docs() -> list[str]:
    """The docs holding a marked table: the README, BENCHMARKS.md and the pages under docs/."""
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [str(p.relative_to(ROOT)) for p in pages if p.exists() and MARKER in p.read_text(encoding="utf-8")]


def failures(claims: tuple[Claim, ...] = CLAIMS) -> list[str]:
    """Every failing claim and every figure of a marked table without one."""
    found = [reason for claim in claims if (reason := check(claim)) is not None]
    for doc in marked_docs():
        found += uncovered(doc, claims)
    return found


RECORDS = f"{RESULTS}/README.md"
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def known_commit(name: str) -> bool:
    """Whether `name` is a commit of this checkout's history (True when the history is not there to ask:
    a shallow clone or an unpacked copy)."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    shallow = subprocess.run([*git, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        return True
    found = subprocess.run(
        [*git, "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"], capture_output=True
    )
    return found.returncode == 0


def record_problems() -> list[str]:
    """Result folders without a machine record or without a row in bench/results/README.md, and commits
    named there or in a record that the history does not have."""
    rows = {
        line.split("|")[1].strip(): line for line in doc_text(RECORDS).splitlines() if line.startswith("| 20")
    }
    problems = []
    for folder in sorted(p for p in (ROOT / RESULTS).iterdir() if p.is_dir()):
        records = [f for f in folder.iterdir() if "machine" in f.name and f.suffix == ".txt"]
        if not records:
            problems.append(f"{folder.name}: no machine record")
        if folder.name not in rows:
            problems.append(f"{folder.name}: no row in {RECORDS}")
        named = [m for f in records for m in re.findall(r"^commit ([0-9a-f]{7,40})", f.read_text(), re.M)]
        named += COMMIT.findall(rows.get(folder.name, ""))
        problems += [
            f"{folder.name}: commit {name} is not in the history" for name in named if not known_commit(name)
        ]
    return problems


def main() -> int:
    wrong = failures() + record_problems()
    for line in wrong:
        print(line)
    print(f"{len(CLAIMS)} claims, {len(wrong)} failures")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
