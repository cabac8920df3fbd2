"""Host memory of loading a checkpoint for each GPU-memory plan: one fresh process per budget loads the
pipeline and reports its peak resident set (VmHWM), the resident set after loading (anonymous, file-backed
and shared: the host copies are shared anonymous pages), the peak of each of those three sampled every 5 ms
while loading (so a second anonymous copy would show apart from the checkpoint's mapped file pages), and
the bytes of its host copies (pinned on CUDA); a process that only imports the pipeline gives the
baseline. Weights load from safetensors memory maps (file-backed pages, no second copy), and each tensor
that waits on the host is copied once into its host buffer.

    python bench/host_memory.py --device cpu --budgets none,60MiB,45MiB,40MiB --out host_memory.json
    python bench/host_memory.py --model /tmp/qwen-image-random-fp8 --budgets none,48GiB,32GiB,24GiB,16GiB \\
        --out host_memory.json                                                  # GPU, ~4 min
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys, threading, time
from pathlib import Path

KINDS = ("RssAnon", "RssFile", "RssShmem")

def status():
    lines = Path("/proc/self/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS", *KINDS)}

peaks = dict.fromkeys(KINDS, 0)

def sample():
    while True:
        now = status()
        for kind in KINDS:
            peaks[kind] = max(peaks[kind], now[kind])
        time.sleep(0.005)

threading.Thread(target=sample, daemon=True).start()
from qwen_image_fusion.pipelines import load_pipeline

model, device, budget = sys.argv[1] or None, sys.argv[2] or None, sys.argv[3]
if budget == "baseline":
    print(json.dumps(status()))
    raise SystemExit
pipe = load_pipeline(model, device=device, gpu_memory=None if budget == "none" else budget)
host = 0 if pipe.memory is None else sum(
    arena.numel() for placed in pipe.memory.placed.values() for arena in placed._arenas
)
summary = "" if pipe.memory is None else pipe.memory.plan.summary()
peak = {f"peak_{kind}": value for kind, value in peaks.items()}
print(json.dumps(status() | peak | {"host_copies": host, "plan": summary}))
"""


def measure(model: str | None, device: str | None, budget: str) -> dict:
    command = [sys.executable, "-c", PROBE, model or "", device or "", budget]
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=repo)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--device")
    parser.add_argument("--budgets", default="none,48GiB,32GiB,24GiB,16GiB", help="'none': no budget")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = {"model": args.model or "embedded-default", "device": args.device, "runs": {}}
    for budget in ["baseline", *args.budgets.split(",")]:
        result["runs"][budget] = measure(args.model, args.device, budget)
        row = result["runs"][budget]
        gib = {k: round(v / 1024**3, 3) for k, v in row.items() if isinstance(v, int)}
        print(budget, gib, row.get("plan", row.get("error", "")), flush=True)
        args.out.write_text(json.dumps(result, indent=2))  # after each: a timeout keeps what was measured


if __name__ == "__main__":
    main()
