"""Requests sharing a batch through `Pipeline.run` on the embedded default: a request's images are the same
bytes whichever batch and slot it runs in, and a request run alone is `Pipeline.generate`.

Both variants this CPU serves: `reference` in FP32 (where an FP32 linear over one row takes another path
than over several, so only fixed batch shapes keep a row's bytes) and `contract` in BF16.
"""

import math

import pytest
import torch
from helpers import png_sha256

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines.batching import STEP_BYTES_PER_MEGAPIXEL, BatchPlan

PROMPTS = [f"a red circle on the left and a blue square on the right, scene {i}" for i in range(4)]


def _hashes(results: list) -> list[list[str]]:
    return [[png_sha256(image) for image in result.images] for result in results]


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_a_request_run_alone_is_generate(bytes_pipe, cfg: bool) -> None:
    values = dict(
        negative_prompt=" " if cfg else None, width=48, height=32, num_inference_steps=3, seed=5,
        num_images_per_prompt=2, true_cfg_scale=4.0 if cfg else 1.0,
    )  # fmt: skip
    [result] = bytes_pipe.run([bytes_pipe.request(PROMPTS[0], **values)])
    alone = bytes_pipe.generate(PROMPTS[0], **values)
    assert _hashes([result]) == [[png_sha256(image) for image in alone]]
    assert set(result.info.timings) == {"text_encoding", "denoising", "decoding", "total"}
    assert result.info.seed == 5 and result.info.shared_by == 1


def test_requests_keep_their_bytes_in_any_batch_and_slot(bytes_pipe) -> None:
    """Three requests alone (each padded to the fixed size of 3), together, and in reverse order: every
    request's PNGs are the same bytes; different prompts and seeds give different images."""
    requests = [
        bytes_pipe.request(prompt, negative_prompt=" ", width=32, height=32, num_inference_steps=2, seed=seed)
        for seed, prompt in enumerate(PROMPTS[:3])
    ]
    alone = [_hashes(bytes_pipe.run([r], slots=3))[0] for r in requests]
    together = bytes_pipe.run(requests, slots=3)
    reversed_ = _hashes(bytes_pipe.run(requests[::-1], slots=3))[::-1]
    assert _hashes(together) == alone == reversed_
    assert len({h for hashes in alone for h in hashes}) == 3
    assert [r.info.shared_by for r in together] == [3, 3, 3]


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_shared_text_encoding_keeps_each_requests_bytes(bytes_pipe, cfg: bool) -> None:
    """Prompts of two token buckets (one exactly at the 64-token edge), encoded in shared calls of the
    batch's 4 rows: each request's PNGs are the same bytes alone (3 copies beside it), with any companions
    and in reverse order."""
    edge = " ".join(["a"] * 25)  # 64 tokens with the template: the first of the 128 bucket
    prompts = [PROMPTS[0], edge, PROMPTS[1], "a blue square"]
    values = dict(width=32, height=32, num_inference_steps=2, negative_prompt=" ")
    values["true_cfg_scale"] = 4.0 if cfg else 1.0
    requests = [bytes_pipe.request(p, seed=seed, **values) for seed, p in enumerate(prompts)]
    assert requests[0].true_cfg == cfg
    alone = [_hashes(bytes_pipe.run([r], slots=4))[0] for r in requests]
    assert _hashes(bytes_pipe.run(requests, slots=4)) == alone
    assert _hashes(bytes_pipe.run(requests[::-1], slots=4))[::-1] == alone
    assert _hashes(bytes_pipe.run(requests[1:3], slots=4)) == alone[1:3]
    assert len({h for hashes in alone for h in hashes}) == 4


def test_a_preset_and_several_images_per_request(bytes_pipe) -> None:
    first, second = (
        bytes_pipe.request(p, width=32, height=48, seed=seed, num_images_per_prompt=2, preset="lightning-4")
        for seed, p in enumerate(PROMPTS[:2])
    )
    assert first.num_inference_steps == 4 and not first.true_cfg  # the preset's steps and CFG scale
    together = _hashes(bytes_pipe.run([first, second], slots=2))
    assert together[1] == _hashes(bytes_pipe.run([second], slots=2))[0]
    assert together[0] == _hashes(bytes_pipe.run([first], slots=2))[0] and len(together[0]) == 2
    assert bytes_pipe.last_run.num_inference_steps == 4 and bytes_pipe.last_run.preset == "lightning-4"


def test_prompts_of_other_lengths_denoise_apart_in_one_run(bytes_pipe) -> None:
    """Conditioning of other shapes cannot stack: one run denoises each shape as its own batch of the
    fixed size, so each request still gets its bytes alone."""
    prompts = ("a red circle", "a red circle at the top left", "a blue circle")
    requests = [
        bytes_pipe.request(p, width=32, height=32, num_inference_steps=2, seed=i)
        for i, p in enumerate(prompts)
    ]
    together = _hashes(bytes_pipe.run(requests, slots=3))
    assert together == [_hashes(bytes_pipe.run([r], slots=3))[0] for r in requests]
    assert [r.info.shared_by for r in bytes_pipe.run(requests, slots=3)] == [2, 1, 2]


def test_requests_that_cannot_share_a_batch_are_refused(bytes_pipe) -> None:
    request = bytes_pipe.request("a red circle", width=32, height=32, num_inference_steps=2, seed=0)
    with pytest.raises(InputError, match="3 requests for a batch of 2"):
        bytes_pipe.run([request] * 3, slots=2)
    other = bytes_pipe.request("a red circle", width=48, height=32, num_inference_steps=2, seed=0)
    with pytest.raises(InputError, match="agree on everything but prompt and seed"):
        bytes_pipe.run([request, other])
    drawn = bytes_pipe.request("a red circle", width=32, height=32, num_inference_steps=2)
    assert drawn.batch_key is None  # a seed drawn at run time: it runs alone
    with pytest.raises(InputError, match="agree on everything but prompt and seed"):
        bytes_pipe.run([drawn], slots=2)


def test_batch_plan_slots_follow_images_and_memory(bytes_pipe) -> None:
    small, big = (bytes_pipe.request("x", width=side, height=side, seed=0) for side in (512, 1024))
    pair = bytes_pipe.request("x", width=512, height=512, seed=0, num_images_per_prompt=2)
    assert BatchPlan(1).slots(small) == 1
    assert BatchPlan(8).slots(small) == 8 and BatchPlan(8).slots(pair) == 4 and BatchPlan(3).slots(pair) == 1
    budget = math.ceil(4 * 1.048576 * STEP_BYTES_PER_MEGAPIXEL)  # four 1024x1024 rows
    assert BatchPlan(16, budget).slots(big) == 4 and BatchPlan(16, budget).slots(small) == 16
    assert BatchPlan(16, 0).slots(big) == 1  # never below one request
    assert BatchPlan.for_device(torch.device("cpu"), 4, planned=False) == BatchPlan(4, None)
