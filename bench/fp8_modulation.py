"""FP8 weight-only modulation against BF16 modulation (issue 24): the embedded default quantized twice from
the same BF16 weights and calibration (`quantize` and `quantize --fp8-modulation`), the held-out scenes
generated with each, colour+position accuracy of each (eval/meaning.py), PSNR/SSIM of each image pair; and
at full size, the bytes saved and the plans at 16, 24 and 32 GiB with and without it (from headers).

    python -m bench.fp8_modulation --scenes 12 --languages en --calib-scenes 4 --calib-steps 8 --out X.json
"""

import argparse
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.header_checkpoint import header_only_checkpoint
from qwen_image_fusion.eval.meaning import (
    CALIBRATION_SEED,
    EvalSettings,
    calibration_prompts,
    generate_held_out,
    image_pair_metrics,
    score,
)
from qwen_image_fusion.eval.scenes import held_out_scenes
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.memory import DENOISE, Workload
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.memory_plan import GiB, plan_memory
from qwen_image_fusion.pipelines.quantize import quantize_pipeline


def full_size(directory: Path) -> dict:
    """Transformer bytes and plans at full size, FP8 with BF16 and with FP8 modulation."""
    rows = {}
    for name, modulation in (("bf16_modulation", False), ("fp8_modulation", True)):
        spec = inspect_checkpoint(header_only_checkpoint(directory / name, fp8_modulation=modulation))
        profile = spec.family.memory_profile(spec, 2, 2)
        plans = {b: plan_memory(profile, b * GiB, Workload(1024, 1024)).summary() for b in (16, 24, 32)}
        rows[name] = {"transformer_bytes": profile.part(DENOISE).total, "plans": plans}
    before, after = (rows[name]["transformer_bytes"] for name in ("bf16_modulation", "fp8_modulation"))
    rows["bytes_saved"] = before - after
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenes", type=int, default=50)
    parser.add_argument(
        "--calib-scenes", type=int, default=16, help="training scenes calibrated on, x2 languages"
    )
    parser.add_argument("--calib-steps", type=int, default=20)
    parser.add_argument("--languages", default="en,zh")
    parser.add_argument("--device")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    settings = EvalSettings(languages=tuple(args.languages.split(",")))
    scenes = held_out_scenes(args.scenes)
    pipe = load_pipeline(variant="contract", device=args.device)
    calibration = {"calib_scenes": args.calib_scenes, "calib_steps": args.calib_steps}
    result, images = {"settings": asdict(settings) | {"scenes": args.scenes} | calibration}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, modulation in (("bf16_modulation", False), ("fp8_modulation", True)):
            out = Path(tmp) / name
            quantize_pipeline(
                pipe, out, calibration_prompts(args.calib_scenes), steps=args.calib_steps, size=settings.size,
                seed=CALIBRATION_SEED, fp8_modulation=modulation,
            )  # fmt: skip
            fp8 = load_pipeline(out, variant="fp8-fused", device=args.device)
            images[name] = generate_held_out(fp8, scenes, settings, name)[0]
            result[name] = {"variant": fp8.variant, "accuracy": score(images[name], scenes)["accuracy"]}
        result["full_size"] = full_size(Path(tmp) / "headers")
    result["fp8_vs_bf16_modulation"] = image_pair_metrics(images["bf16_modulation"], images["fp8_modulation"])
    result["seconds"] = time.perf_counter() - start
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
