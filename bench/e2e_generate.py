"""End-to-end `generate()` timing per stage on a checkpoint: one warm-up run, then timed runs.

python bench/e2e_generate.py --model DIR [--size 1024] [--steps 50] [--runs 2]
"""

import argparse
import json
import statistics

from pipelines import load_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    pipe = load_pipeline(args.model)
    kwargs = dict(negative_prompt=" ", width=args.size, height=args.size, num_inference_steps=args.steps)
    pipe.generate("warm-up: a lighthouse at dusk", seed=0, **kwargs)
    runs = []
    for i in range(args.runs):
        pipe.generate("a red fox in the snow, detailed fur", seed=i + 1, **kwargs)
        runs.append(pipe.last_run.timings | {"ms_per_step": pipe.last_run.ms_per_step})
    summary = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    print(json.dumps({"variant": pipe.variant, "size": args.size, "steps": args.steps, "median": summary}))
    print(pipe.fusion_summary().splitlines()[0])


if __name__ == "__main__":
    main()
