"""A batch's prompts encoded together (`FamilyModel.encode_batch`, `Pipeline.run` with `slots` above one):
a request's conditioning is the same bytes whatever its companions (other prompts, other token buckets, a
prompt exactly at a bucket's edge), shaped as encoding it alone shapes it; one text-encoder call runs per
CFG branch and token bucket, under a memory plan too (which counts the batch's prompts per call); families
that do not opt in encode each request alone. Each request's PNGs: tests/test_batching.py.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from edit_fixtures import build_edit_checkpoint, drawn_image, our_edit_pipeline
from helpers import png_sha256
from qi21_checkpoints import build_qi21_checkpoint

from qwen_image_fusion.models.qwen_image.prompt_template import PROMPT_TEMPLATE
from qwen_image_fusion.models.qwen_image.text_encoder import LOG, token_bucket
from qwen_image_fusion.pipelines import load_pipeline

FOX = "a red fox in the snow"


def words(count: int) -> str:
    """A prompt of `count` tokens: with the template, 39 + `count` (checked in the tests that lean on it)."""
    return " ".join(["a"] * count)


EDGE = words(25)  # 64 tokens with the template: the first prompt of the 128 bucket
BELOW = words(24)  # 63: the last of the 64 bucket


@contextmanager
def encoder_calls(bytes_pipe) -> Iterator[list[torch.Tensor]]:
    """The attention mask [rows, tokens] of every text-encoder forward while inside."""
    encoder, calls = bytes_pipe.components.text_encoder, []
    forward = encoder.forward

    def counted(*args, **kwargs):
        calls.append(kwargs["attention_mask"])
        return forward(*args, **kwargs)

    encoder.forward = counted
    try:
        yield calls
    finally:
        del encoder.forward


def test_buckets_sit_strictly_above_each_prompts_own_tokens(bytes_pipe) -> None:
    tokens = [
        len(bytes_pipe.components.tokenizer(PROMPT_TEMPLATE.format(p)).input_ids) for p in (BELOW, EDGE)
    ]
    assert tokens == [63, 64]
    assert [token_bucket(n, 512) for n in (39, 63, 64, 127, 128)] == [64, 64, 128, 128, 192]
    assert token_bucket(512 + 34, 512) == token_bucket(530, 512) == 547  # the cap: one pad past what is kept
    assert token_bucket(16 + 34, 16) == 51 and token_bucket(40, 16) == 51


@pytest.mark.parametrize("own", [FOX, EDGE, BELOW], ids=["short", "edge", "below-edge"])
def test_a_prompts_conditioning_does_not_depend_on_its_companions(bytes_pipe, own: str) -> None:
    """Its row in batches of 4 with companions of its own bucket, of others, at the edge and just below,
    in every position: equal tensors; shaped as `encode` shapes it alone, no mask."""
    model = bytes_pipe.model
    [first, *_] = model.encode_batch([own], 512, 4)
    companions = [["b"], ["a blue square", "c", "d"], [EDGE, BELOW], ["long " * 90, EDGE, "x"], [own, own]]
    for others in companions:
        for position in range(len(others) + 1):
            prompts = [*others[:position], own, *others[position:]]
            got = model.encode_batch(prompts, 512, 4)[position]
            assert torch.equal(got.embeds, first.embeds) and got.mask is None
    alone = model.encode([own], 512)
    assert alone.embeds.shape == first.embeds.shape and alone.mask is None
    # The same prompt and arithmetic at another GEMM shape (its sums split otherwise): a few roundings of its
    # largest value in its dtype at most (measured: one, in FP32 and in BF16)
    ulp = torch.finfo(first.embeds.dtype).eps * first.embeds.float().abs().max()
    assert (alone.embeds.float() - first.embeds.float()).abs().max() <= 4 * ulp
    different = model.encode_batch(["b"], 512, 4)[0]
    assert not torch.equal(different.embeds[:, :2], first.embeds[:, :2])


def test_long_prompts_are_cut_and_warned_about_as_alone(bytes_pipe, caplog) -> None:
    """At `max_sequence_length` 16, a 90-word prompt keeps 16 tokens, as alone, whatever its companions,
    and the dropped tokens are still reported."""
    model, long = bytes_pipe.model, "long " * 90
    LOG.addHandler(caplog.handler)  # the CLI, run in-process by other tests, stops it propagating
    try:
        [cut, short] = model.encode_batch([long, "b"], 16, 2)
    finally:
        LOG.removeHandler(caplog.handler)
    assert "were dropped" in caplog.text and "past max_sequence_length 16" in caplog.text
    assert cut.embeds.shape == model.encode([long], 16).embeds.shape == (1, 16, cut.embeds.shape[-1])
    assert torch.equal(model.encode_batch(["c", long], 16, 2)[1].embeds, cut.embeds)
    assert short.embeds.shape == model.encode(["b"], 16).embeds.shape


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_one_encoder_call_per_branch_and_bucket(bytes_pipe, cfg: bool) -> None:
    """Four requests in two buckets: one call per bucket (and one for the negative prompts, all in one
    bucket), each of `slots` rows, not one per request; every request reports the shared seconds."""
    values = dict(width=32, height=32, num_inference_steps=2, negative_prompt=" ", num_images_per_prompt=2)
    values["true_cfg_scale"] = 4.0 if cfg else 1.0
    prompts = [FOX, EDGE, "a blue square", BELOW]
    requests = [bytes_pipe.request(p, seed=i, **values) for i, p in enumerate(prompts)]
    with encoder_calls(bytes_pipe) as calls:
        results = bytes_pipe.run(requests, slots=5)
    assert sorted(tuple(m.shape) for m in calls) == sorted([(5, 64), (5, 128)] + ([(5, 64)] if cfg else []))
    assert all((mask == 0).any(dim=1).all() for mask in calls)  # every row ends in a pad: the masked path
    timings = {r.info.timings["text_encoding"] for r in results}
    assert len(timings) == 1 and timings.pop() > 0
    assert [len(r.images) for r in results] == [2] * 4
    with encoder_calls(bytes_pipe) as calls:
        bytes_pipe.run(requests[:1])  # alone (slots 1): as `generate`, its own call per branch
    assert [len(mask) for mask in calls] == [1] * (2 if cfg else 1)


def test_shared_encoding_under_a_memory_plan_keeps_the_bytes(bytes_pipe) -> None:
    """Under a plan (the CPU standing in for the GPU) the batch's calls run inside it, checked at the batch's
    prompts per call, and give the bytes of the same batch without a plan."""
    dtype = "fp32" if bytes_pipe.dtype == torch.float32 else "bf16"
    planned = load_pipeline(variant=bytes_pipe.variant, device="cpu", dtype=dtype, gpu_memory="1GiB")
    values = dict(width=32, height=32, num_inference_steps=2, negative_prompt=" ")
    requests = [planned.request(p, seed=i, **values) for i, p in enumerate(("b", FOX, EDGE))]
    checked, check = [], planned.memory.request
    planned.memory.request = lambda workload: checked.append(workload) or check(workload)
    with encoder_calls(planned) as calls:
        together = planned.run(requests, slots=3)
    assert sorted(tuple(m.shape) for m in calls) == [(3, 64), (3, 64), (3, 128)]
    assert [w.prompts for w in checked] == [3]
    unplanned = bytes_pipe.run(
        [bytes_pipe.request(r.prompts[0], seed=r.seed, **values) for r in requests], slots=3
    )
    assert [png_sha256(r.images[0]) for r in together] == [png_sha256(r.images[0]) for r in unplanned]


def test_families_that_do_not_opt_in_encode_each_request_alone(tmp_path) -> None:
    """Edit's prompts see its images: no shared encoding, and its requests run as before. Qwen-Image 2.1
    does not opt in: a text-only batch of two encodes each request alone."""
    assert load_pipeline(dtype="fp32", variant="reference").spec.shares_text_encoding
    edit = our_edit_pipeline(build_edit_checkpoint(tmp_path / "edit", "QwenImageEditPipeline", False))
    assert not edit.spec.shares_text_encoding
    image = drawn_image(64, 48, seed=1)
    with encoder_calls(edit) as calls:
        [result] = edit.run([edit.request("make it blue", image=image, num_inference_steps=2, seed=0)])
    assert len(calls) == 1 and len(result.images) == 1
    qi21 = load_pipeline(build_qi21_checkpoint(tmp_path / "qi21"), variant="reference", dtype="fp32")
    assert not qi21.spec.shares_text_encoding
    with pytest.raises(NotImplementedError):
        qi21.model.encode_batch(["b"], 512, 2)
    requests = [
        qi21.request(p, width=64, height=64, num_inference_steps=2, seed=0, true_cfg_scale=1.0)
        for p in ("b", FOX)
    ]
    with encoder_calls(qi21) as calls:
        results = qi21.run(requests, slots=2)
    assert [len(mask) for mask in calls] == [1, 1] and len(results) == 2
