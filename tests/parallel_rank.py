"""One rank of the gloo tests (tests/test_parallel_gloo.py): generates with several plans, rank 0 writes the
images and what it saw to OUT_DIR.

    python tests/parallel_rank.py SCENARIO OUT_DIR [FP8_DIR]

(as ranks of qwen_image_fusion.ui.launch or torchrun)

Scenarios: `two` (CFG-2 and Ulysses-2 on BF16 and FP8, no host syncs in a sharded step, the web demo's
leader and follower), `four` (CFG-2 x Ulysses-2), `die` (rank 1 exits after its first step), `gpu`
(tests/gpu/test_parallel_gpu.py: CFG-2 and Ulysses-2 on two GPUs, graphs and eager), `edit` (the tiny
Edit-2511 transformer under Ulysses: the per-token modulation index splits with the image rows),
`edit-cfg` (an Edit checkpoint's pipeline under CFG-2: FP8_DIR is the Edit checkpoint), `qi21` (a tiny
Qwen-Image 2.1 checkpoint, the third argument, under CFG-2 with a condition image, KV cache on and off;
Ulysses refused).
"""

import json
import math
import os
import sys
import time
from pathlib import Path

from qwen_image_fusion.models.cache_presets import CachePreset
from qwen_image_fusion.models.errors import InputError, ParallelError
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.parallel import ParallelPlan

PROMPTS = ["a red fox", "a long prompt about a small blue bird singing on a branch at dawn"]
SIZE = dict(width=64, height=48, num_inference_steps=2, seed=3)
CFG_ON = dict(negative_prompt="blurry", **SIZE)
# BF16 numerics pinned on both sides of every comparison: the CPU's own default (FP32 on CPUs without
# native BF16) would tie the bytes to the CPU the suite meets.
BF16 = dict(dtype="bf16", variant="contract")
# a step cache that skips whenever it may (2 warm-up steps, then 2 skipped for each 1 run)
CACHED = dict(CFG_ON, num_inference_steps=6, cache=CachePreset("always", math.inf, max_cached_in_a_row=2))
GPU_ARGS = dict(negative_prompt=" ", width=256, height=192, num_inference_steps=10, seed=3)


def generate_all(pipe) -> dict[str, list]:
    """The images every scenario compares: true CFG on and off, two prompts of different lengths (padded)."""
    return {"cfg": pipe.generate(PROMPTS, **CFG_ON), "nocfg": pipe.generate(PROMPTS, **SIZE)}


def save(out: Path, name: str, images: list) -> None:
    for i, image in enumerate(images):
        image.save(out / f"{name}-{i}.png")


def sharded_step_has_no_host_sync(pipe) -> bool:
    from helpers import step_without_host_sync

    step_without_host_sync(pipe.transformer, (1, 3, 4), pipe.device)
    return True


def web_demo_jobs(pipe, out: Path) -> dict:
    """Rank 0 leads four jobs as the demo's Runner would (one stopped, one refused); the others follow."""
    from qwen_image_fusion.ui.limits import Limits
    from qwen_image_fusion.ui.ranks import Leader, follow
    from qwen_image_fusion.ui.runner import STOP_PRESSED, Job, Runner, Stopped

    if not pipe.ranks.is_leader:
        follow(pipe)
        return {}
    leader = Leader(pipe)
    runner = Runner(leader, Limits.for_device("cpu", time_limit_s=600))
    seen = {}

    def job(prompt: str, **kwargs) -> Job:
        return Job("session", pipe.variant, pipe.request(prompt, **kwargs))

    def stop_at_first_step(i: int, total: int) -> None:
        runner.stop_session("session", STOP_PRESSED)

    images, _ = runner.run(job(PROMPTS[0], **CFG_ON), lambda i, n: None)
    save(out, "demo-first", images)
    try:
        runner.run(job(PROMPTS[0], **CFG_ON), stop_at_first_step)
    except Stopped:
        seen["stopped"] = True
    try:
        runner.run(job(" ", **CFG_ON), lambda i, n: None)
    except InputError as err:
        seen["refused"] = str(err)
    random_seed = {**CFG_ON, "seed": None}  # every rank must draw rank 0's seed
    images, run = runner.run(job(PROMPTS[1], **random_seed), lambda i, n: None)
    save(out, "demo-last", images)
    seen["last_seed"] = run.seed
    leader.close()
    return seen


def run_two(out: Path, fp8: str) -> dict:
    pipe = load_pipeline(device="cpu", parallel=ParallelPlan(cfg=2), **BF16)
    for name, images in generate_all(pipe).items():
        save(out, f"bf16-cfg2-{name}", images)
    save(out, "bf16-cfg2-cached", pipe.generate(PROMPTS, **CACHED))
    cached_run = pipe.last_run.cache.summary()
    seen = web_demo_jobs(pipe, out)
    seen["cfg2_cached_run"] = cached_run
    pipe.set_parallel(ParallelPlan(ulysses=2))
    try:
        pipe.generate(PROMPTS, **CACHED)
    except InputError as err:  # on every rank alike, before any collective
        seen["ulysses_cache"] = str(err)
    for name, images in generate_all(pipe).items():
        save(out, f"bf16-u2-{name}", images)
    seen["no_host_sync"] = sharded_step_has_no_host_sync(pipe)
    try:
        pipe.generate(PROMPTS[0], max_sequence_length=1, **SIZE)
    except InputError as err:  # on every rank alike, before any collective
        seen["one_text_token"] = str(err)

    fp8_pipe = load_pipeline(fp8, device="cpu", parallel=ParallelPlan(ulysses=2))
    for variant in ("fp8-fused", "fp8-unfused"):
        fp8_pipe.set_variant(variant)
        save(out, f"{variant}-u2-cfg", fp8_pipe.generate(PROMPTS, **CFG_ON))
    fp8_pipe.set_parallel(ParallelPlan(cfg=2))
    fp8_pipe.set_variant("fp8-fused")
    save(out, "fp8-fused-cfg2-cfg", fp8_pipe.generate(PROMPTS, **CFG_ON))
    return seen


def run_four(out: Path, fp8: str) -> dict:
    pipe = load_pipeline(device="cpu", parallel="auto", **BF16)
    for name, images in generate_all(pipe).items():
        save(out, f"bf16-c2u2-{name}", images)
    fp8_pipe = load_pipeline(fp8, device="cpu", parallel="auto")
    for variant in ("fp8-fused", "fp8-unfused"):
        fp8_pipe.set_variant(variant)
        save(out, f"{variant}-c2u2-cfg", fp8_pipe.generate(PROMPTS, **CFG_ON))
    return {"plan": pipe.parallel_summary()}


def run_gpu(out: Path, fp8: str) -> dict:
    pipe = load_pipeline(fp8, device="cuda", parallel=ParallelPlan(cfg=2))
    save(out, "cfg2", pipe.generate(PROMPTS, **GPU_ARGS))
    pipe.set_parallel(ParallelPlan(ulysses=2))
    save(out, "u2-fused", pipe.generate(PROMPTS, **GPU_ARGS))
    seen = {"graphs": bool(pipe._graphed.graphs), "fusion": pipe.fusion_summary().splitlines()[0]}
    pipe.cuda_graphs = False
    save(out, "u2-fused-eager", pipe.generate(PROMPTS, **GPU_ARGS))
    pipe.cuda_graphs = True
    pipe.set_variant("fp8-unfused")
    save(out, "u2-unfused", pipe.generate(PROMPTS, **GPU_ARGS))
    seen["no_host_sync"] = sharded_step_has_no_host_sync(pipe)
    return seen


def run_die(out: Path) -> dict:
    pipe = load_pipeline(device="cpu", parallel=ParallelPlan(cfg=2), **BF16)

    def die_after_first_step(i: int, total: int) -> None:
        if pipe.ranks.rank == 1:
            os._exit(3)

    start = time.monotonic()
    try:
        pipe.generate(PROMPTS, on_step=die_after_first_step, **{**CFG_ON, "num_inference_steps": 4})
    except ParallelError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None}


def run_edit(out: Path, _: str | None) -> dict:
    """One Edit-2511 step (BF16 reference numerics, FP8 fused and unfused) sharded over the ranks; rank 0
    saves the velocities to OUT_DIR/edit.pt."""
    import torch
    import torch.distributed as dist
    from edit_fixtures import EDIT_LAYOUT, edit_step_inputs, fp8_edit_transformer, tiny_edit_transformer
    from helpers import step_without_host_sync

    from qwen_image_fusion.models.sequence_parallel import shard_sequence

    dist.init_process_group("gloo")
    models = {"bf16": tiny_edit_transformer(), "fp8": fp8_edit_transformer()}
    inputs = edit_step_inputs(2, EDIT_LAYOUT, 9, torch.bfloat16, True)
    outputs = {}
    with torch.no_grad():
        for name, model in models.items():
            shard_sequence(model, dist.group.WORLD)
            outputs[name] = model(*inputs, EDIT_LAYOUT)
        models["fp8"].post_load_weights(fuse=False)
        outputs["fp8-unfused"] = models["fp8"](*inputs, EDIT_LAYOUT)
        models["fp8"].post_load_weights()
    step_without_host_sync(models["fp8"], EDIT_LAYOUT, text_tokens=7, pad_from=4)
    if dist.get_rank() == 0:
        torch.save(outputs, out / "edit.pt")
    dist.destroy_process_group()
    return {"fusion": models["fp8"].fusion_report.summary().splitlines()[0], "no_host_sync": True}


QI21_PROMPTS = ["make it snow", "a much longer prompt: make it snow and add a red sledge"]


def qi21_args() -> dict:
    """The 2.1 request every rank and the one process make: a condition image, true CFG, three steps."""
    from edit_fixtures import drawn_image

    image = drawn_image(96, 64, seed=4, mode="RGBA")
    return dict(image=image, negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=3, seed=3)


def run_qi21(out: Path, model: str) -> dict:
    from qi21_checkpoints import RESOLUTION

    pipe = load_pipeline(model, variant="reference", device="cpu", dtype="fp32", parallel=ParallelPlan(cfg=2))
    pipe.model.resolution = RESOLUTION
    for cache in (True, False):
        pipe.model.use_kv_cache = cache
        save(out, f"qi21-cfg2-{'cache' if cache else 'nocache'}", pipe.generate(QI21_PROMPTS, **qi21_args()))
    seen = {"plan": pipe.parallel_summary()}
    try:
        pipe.set_parallel(ParallelPlan(ulysses=2))
    except InputError as err:  # on every rank alike, before any collective
        seen["ulysses"] = str(err)
    return seen


EDIT_ARGS = dict(negative_prompt="blurry", width=48, height=32, num_inference_steps=2, seed=3)


def edit_inputs() -> list:
    from edit_fixtures import drawn_image

    return [drawn_image(60, 44, 1), drawn_image(37, 52, 2, "RGBA")]


def run_edit_cfg(out: Path, edit_dir: str) -> dict:
    """Edits of an Edit-2511-like checkpoint under CFG-2, true CFG on and off (small image areas)."""
    from edit_fixtures import SMALL_CONDITION_AREA, SMALL_VAE_AREA

    pipe = load_pipeline(edit_dir, device="cpu", parallel=ParallelPlan(cfg=2))
    pipe.model.vae_area, pipe.model.condition_area = SMALL_VAE_AREA, SMALL_CONDITION_AREA
    save(out, "edit-cfg2-cfg", pipe.generate("put 1 beside 2", image=edit_inputs(), **EDIT_ARGS))
    no_cfg = {**EDIT_ARGS, "negative_prompt": None}
    save(out, "edit-cfg2-nocfg", pipe.generate("put 1 beside 2", image=edit_inputs(), **no_cfg))
    return {"plan": pipe.parallel_summary()}


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    fp8 = sys.argv[3] if len(sys.argv) > 3 else None
    runs = {
        "two": run_two,
        "four": run_four,
        "gpu": run_gpu,
        "edit": run_edit,
        "edit-cfg": run_edit_cfg,
        "qi21": run_qi21,
    }
    seen = runs[scenario](out, fp8) if scenario != "die" else run_die(out)
    if os.environ.get("RANK") == "0":
        (out / "seen.json").write_text(json.dumps(seen))
    return 1 if seen.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
