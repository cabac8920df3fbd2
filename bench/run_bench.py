"""Balanced step benchmark: each variant in its own process, alternating order, tables in JSON + Markdown.

    python bench/run_bench.py --variants diffusers,contract,fp8-unfused,fp8-fused+graph --rounds 2 --out DIR

A `+graph` suffix replays the step as a captured CUDA graph.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def balanced_order(variants: list[str], rounds: int) -> list[str]:
    """ABC CBA ABC ...: each variant equally often early and late."""
    return [v for r in range(rounds) for v in (variants if r % 2 == 0 else variants[::-1])]


def markdown(rows: list[dict]) -> str:
    lines = [
        "| variant | size | batch | runs | median ms | min ms | max ms | fused paths |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['size']} | {r['batch']} | {len(r['ms'])} | {r['median_ms']:.1f} "
            f"| {min(r['ms']):.1f} | {max(r['ms']):.1f} | {r['fusion_summary']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="diffusers,reference,contract,fp8-unfused,fp8-fused")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="passed to step_bench.py after --")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = [a for a in args.extra if a != "--"]
    samples: dict[tuple, dict] = {}
    order = balanced_order(args.variants.split(","), args.rounds)
    for i, variant in enumerate(order, 1):
        start = time.time()
        name, graph = variant.removesuffix("+graph"), variant.endswith("+graph")
        script = str(Path(__file__).with_name("step_bench.py"))
        cmd = [sys.executable, script, "--variant", name, *(["--graph"] if graph else []), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        print(f"[{i}/{len(order)}] {variant}: {time.time() - start:.0f} s, rc {proc.returncode}", flush=True)
        if proc.returncode:
            print(proc.stderr[-3000:], flush=True)
            continue
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                key = (row["variant"], row["size"], row["batch"])
                samples.setdefault(key, row | {"ms": []})["ms"].extend(row["ms"])
    rows = []
    for row in samples.values():
        row["median_ms"] = statistics.median(row["ms"])
        rows.append(row)
    rows.sort(key=lambda r: (r["size"], r["batch"], r["median_ms"]))
    (args.out / "step_bench.json").write_text(json.dumps(rows, indent=2))
    table = markdown(rows)
    (args.out / "step_bench.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
