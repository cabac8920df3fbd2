"""Batched requests (pipelines/batching.py) on the embedded default: a request's images are the same bytes
whichever batch and slot it runs in, and a batch of one equals `Pipeline.generate`.

Both variants this CPU serves: `reference` in FP32 (where an FP32 linear over one row takes another path
than over several, so only fixed batch shapes keep a row's bytes) and `contract` in BF16.
"""

import math

import pytest
import torch
from helpers import png_sha256

from pipelines import load_pipeline
from pipelines.batching import (
    STEP_BYTES_PER_MEGAPIXEL,
    BatchPlan,
    BatchRequest,
    BatchSettings,
    encode,
    run_batch,
)

PROMPTS = [f"a red circle on the left and a blue square on the right, scene {i}" for i in range(4)]


@pytest.fixture(scope="module", params=[("reference", "fp32"), ("contract", "bf16")], ids=lambda p: p[0])
def pipe(request: pytest.FixtureRequest):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU kernels may split sums by thread count: compare under one
    yield load_pipeline(variant=request.param[0], dtype=request.param[1])
    torch.set_num_threads(threads)


def _encoded(
    pipe, settings: BatchSettings, prompt: str, seed: int, negative: str | None = " "
) -> BatchRequest:
    request = BatchRequest(prompt, negative, seed)
    encode(pipe, request, settings)
    return request


def _hashes(images_per_request: list[list]) -> list[list[str]]:
    return [[png_sha256(image) for image in images] for images in images_per_request]


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_a_batch_of_one_equals_generate(pipe, cfg: bool) -> None:
    settings = BatchSettings(48, 32, 3, 4.0, true_cfg=cfg, num_images_per_prompt=2)
    request = _encoded(pipe, settings, PROMPTS[0], seed=5, negative=" " if cfg else None)
    images, timings = run_batch(pipe, [request], settings, slots=1)
    negative = " " if cfg else None
    alone = pipe.generate(
        PROMPTS[0], negative_prompt=negative, width=48, height=32, num_inference_steps=3, seed=5,
        num_images_per_prompt=2, true_cfg_scale=4.0 if cfg else 1.0,
    )  # fmt: skip
    assert _hashes(images) == _hashes([alone])
    assert set(timings) == {"denoising", "decoding"}


def test_requests_keep_their_bytes_in_any_batch_and_slot(pipe) -> None:
    """Three requests alone (each padded to the fixed size of 3), together, and in reverse order: every
    request's PNGs are the same bytes; different prompts and seeds give different images."""
    settings = BatchSettings(32, 32, 2, 4.0, true_cfg=True, num_images_per_prompt=1)
    requests = [_encoded(pipe, settings, prompt, seed) for seed, prompt in enumerate(PROMPTS[:3])]
    alone = [_hashes(run_batch(pipe, [r], settings, slots=3)[0])[0] for r in requests]
    together = _hashes(run_batch(pipe, requests, settings, slots=3)[0])
    reversed_ = _hashes(run_batch(pipe, requests[::-1], settings, slots=3)[0])[::-1]
    assert together == alone == reversed_
    assert len({h for hashes in alone for h in hashes}) == 3


def test_a_preset_and_several_images_per_request(pipe) -> None:
    settings = BatchSettings(32, 48, 4, 1.0, true_cfg=False, num_images_per_prompt=2, preset="lightning-4")
    first, second = (_encoded(pipe, settings, p, seed, None) for seed, p in enumerate(PROMPTS[:2]))
    together = _hashes(run_batch(pipe, [first, second], settings, slots=2)[0])
    assert together[1] == _hashes(run_batch(pipe, [second], settings, slots=2)[0])[0]
    alone = pipe.generate(
        PROMPTS[0], width=32, height=48, seed=0, num_images_per_prompt=2, preset="lightning-4",
        negative_prompt=None,
    )  # fmt: skip
    assert pipe.last_run.num_inference_steps == 4 and len(together[0]) == 2
    assert together[0] == _hashes(run_batch(pipe, [first], settings, slots=2)[0])[0]
    assert len(alone) == 2


def test_signature_keeps_apart_prompts_of_other_lengths(pipe) -> None:
    settings = BatchSettings(32, 32, 2, 4.0, true_cfg=True)
    short, long = (_encoded(pipe, settings, p, 0) for p in ("a red circle", "a red circle at the top left"))
    assert short.signature != long.signature
    assert short.signature == _encoded(pipe, settings, "a blue circle", 1).signature
    with pytest.raises(ValueError, match="3 requests for a batch of 2"):
        run_batch(pipe, [short] * 3, settings, slots=2)


def test_batch_plan_slots_follow_images_and_memory() -> None:
    small = BatchSettings(512, 512, 8, 1.0, true_cfg=False)
    pair = BatchSettings(512, 512, 8, 1.0, true_cfg=False, num_images_per_prompt=2)
    big = BatchSettings(1024, 1024, 8, 1.0, true_cfg=False)
    assert BatchPlan(1).slots(small) == 1
    assert BatchPlan(8).slots(small) == 8 and BatchPlan(8).slots(pair) == 4 and BatchPlan(3).slots(pair) == 1
    budget = math.ceil(4 * 1.048576 * STEP_BYTES_PER_MEGAPIXEL)  # four 1024x1024 rows
    assert BatchPlan(16, budget).slots(big) == 4 and BatchPlan(16, budget).slots(small) == 16
    assert BatchPlan(16, 0).slots(big) == 1  # never below one request
    assert BatchPlan.for_device(torch.device("cpu"), 4) == BatchPlan(4, None)
