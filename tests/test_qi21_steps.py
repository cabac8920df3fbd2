"""How the Qwen-Image 2.1 family runs its steps through the shared pipeline (CPU, tiny checkpoint): with the
KV cache, each request's CFG branch runs its full pass once, eagerly (`graphable=False`), and every later step
is the target-only pass, graphable and free of host syncs; the cache slots outlive a request so a captured
step replays for the next request of the same shape, and a branch whose slot another request has used runs
its full pass again. Without the cache every step is the full pass."""

import pytest
import torch
from edit_fixtures import drawn_image
from helpers import NoHostSync, png_sha256
from qi21_checkpoints import RESOLUTION, build_qi21_checkpoint

from qwen_image_fusion.models.qwen_image21 import steps
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.stages import denoise

PROMPT, NEGATIVE = "make the sky blue and add a small boat", "blurry, low quality, dark"
IMAGE = drawn_image(96, 64, seed=5, mode="RGBA")
ARGS = dict(image=IMAGE, negative_prompt=NEGATIVE, true_cfg_scale=3.0, num_inference_steps=4, seed=2)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    pipe = load_pipeline(build_qi21_checkpoint(tmp_path_factory.mktemp("qi21") / "ckpt"), dtype="fp32")
    pipe.model.resolution = RESOLUTION
    return pipe


@pytest.fixture
def calls(pipe, monkeypatch):
    """Every StepCall the model makes while a test runs, in order."""
    made = []
    step_call = pipe.model.step_call

    def record(*args):
        made.append(step_call(*args))
        return made[-1]

    monkeypatch.setattr(pipe.model, "step_call", record)
    pipe.model.use_kv_cache = True
    yield made
    pipe.model.use_kv_cache = True


def kinds(made) -> list[str]:
    return ["full" if isinstance(c.static[0], steps.FullPass) else "target" for c in made]


def test_each_branch_runs_its_prefix_once_then_graphable_target_steps(pipe, calls):
    pipe.generate(PROMPT, **ARGS)
    assert kinds(calls) == ["full", "full"] + ["target"] * 6  # two CFG branches, four steps
    assert [c.graphable for c in calls] == [False, False] + [True] * 6
    first, second = (c.static[0] for c in calls[:2])
    assert first.slot is not second.slot, "each CFG branch keeps its own cache"
    targets = {c.static[0] for c in calls[2:]}
    assert targets == {first.slot, second.slot}
    latents, sigma, rope, mask = calls[2].tensors
    assert latents.shape[1] == rope.shape[0] == first.layout.target_len and sigma.shape == (1,)
    assert mask is None  # one prompt: no padding


def test_a_request_of_the_same_shape_reuses_the_slots_and_refills_them(pipe, calls):
    pipe.generate(PROMPT, **ARGS)
    slots = dict(pipe.model.planner.slots)
    first = [png_sha256(im) for im in pipe.generate(PROMPT, **ARGS)]
    other = [png_sha256(im) for im in pipe.generate("make the sky green and add a small boat", **ARGS)]
    again = [png_sha256(im) for im in pipe.generate(PROMPT, **ARGS)]
    assert pipe.model.planner.slots == slots, "same-shape requests reuse the buffers (and the graphs on them)"
    assert first == again != other
    assert kinds(calls) == (["full", "full"] + ["target"] * 6) * 4  # every request fills its prefix anew


def test_a_branch_refills_its_slot_after_another_request_used_it(pipe):
    """A request's canvas and branches reused after another request of the same shape ran: its slot holds the
    other prefix, so its next step is the full pass again, and the result is what it was."""
    model = pipe.model
    model.use_kv_cache = True

    def request(prompt):
        inputs = [IMAGE]
        width, height = model.default_size(inputs)
        branches = [pipe.encode([prompt], 512, images=inputs)]
        return branches, model.canvas(width, height, inputs)

    a, b = request(PROMPT), request("make the sky green and add a small boat")
    first = denoise(pipe, *a, steps=3, true_cfg_scale=1.0, seed=1)
    denoise(pipe, *b, steps=3, true_cfg_scale=1.0, seed=1)
    assert torch.equal(denoise(pipe, *a, steps=3, true_cfg_scale=1.0, seed=1), first)


def test_without_the_cache_every_step_is_the_full_pass(pipe, calls):
    pipe.model.use_kv_cache = False
    pipe.generate(PROMPT, **ARGS)
    assert kinds(calls) == ["full"] * 8 and all(c.graphable for c in calls)
    assert len({c.static[0] for c in calls}) == 2, "one full pass (one captured graph) per branch"
    assert all(c.static[0].cache is None for c in calls)


def test_target_step_makes_no_host_sync(pipe, monkeypatch):
    """The target step of a padded prompt batch with a condition image runs under NoHostSync (which fails on
    any device-to-host read or tensor made from host data), as it must to be captured in a CUDA graph."""
    run = steps.CacheSlot.run
    guarded = []

    def run_guarded(self, *args):
        with NoHostSync():
            guarded.append(run(self, *args))
        return guarded[-1]

    monkeypatch.setattr(steps.CacheSlot, "run", run_guarded)
    pipe.model.use_kv_cache = True
    pipe.generate(["a cat", "a much longer prompt about a dog"], image=IMAGE, num_inference_steps=3, seed=1)
    assert len(guarded) == 2
