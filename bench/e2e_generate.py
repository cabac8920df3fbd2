"""End-to-end `generate()` timing per stage on a checkpoint: one warm-up run, then timed runs.

The warm-up uses the timed prompt (another seed): CUDA graphs are captured per prompt length, so a
warm-up prompt of another length would leave a capture inside the first timed run.

python bench/e2e_generate.py --model DIR [--size 1024] [--steps 50] [--runs 2]
"""

import argparse
import json
import statistics

from qwen_image_fusion.pipelines import load_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    pipe = load_pipeline(args.model)
    kwargs = dict(negative_prompt=" ", width=args.size, height=args.size, num_inference_steps=args.steps)
    prompt = "a red fox in the snow, detailed fur"
    pipe.generate(prompt, seed=0, **kwargs)
    runs = []
    for i in range(args.runs):
        pipe.generate(prompt, seed=i + 1, **kwargs)
        runs.append(pipe.last_run.timings | {"ms_per_step": pipe.last_run.ms_per_step})
    summary = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    print(json.dumps({"variant": pipe.variant, "size": args.size, "steps": args.steps, "median": summary}))
    print(pipe.fusion_summary().splitlines()[0])


if __name__ == "__main__":
    main()
