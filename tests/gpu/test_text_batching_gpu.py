"""GPU checks of a batch's shared text encoding (`FamilyModel.encode_batch`, `Pipeline.run` with `slots`
above one) on the embedded default in BF16: a request's conditioning is the same tensor whatever its
companions (cuBLAS and SDPA pick kernels by shape; the fixed (rows, bucket) shape and the pad every row ends
in keep them), and the HTTP server with batching on answers each request with the bytes of it alone."""

import pytest
import torch
from helpers import check_served_batches, png_sha256

from qwen_image_fusion.pipelines import load_pipeline

pytestmark = pytest.mark.gpu
PROMPTS = [f"a red fox in the snow, picture {i}" for i in range(4)]
EDGE = " ".join(["a"] * 25)  # 64 tokens with the template: the first of the 128 bucket
LONG = "a lighthouse on a cliff at dusk, waves below, " * 4  # the 128 bucket


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(device="cuda", dtype="bf16")


@pytest.mark.parametrize("own", [PROMPTS[0], EDGE, LONG], ids=["short", "edge", "long"])
def test_conditioning_does_not_depend_on_companions_on_gpu(pipe, own: str) -> None:
    [first] = pipe.model.encode_batch([own], 512, 4)
    for others in (["b"], [EDGE, LONG], [LONG, "c", "d"], [own, own, own], PROMPTS[1:]):
        for position in range(len(others) + 1):
            prompts = [*others[:position], own, *others[position:]]
            got = pipe.model.encode_batch(prompts, 512, 4)[position]
            assert torch.equal(got.embeds, first.embeds) and got.mask is None
    assert first.embeds.shape == pipe.model.encode([own], 512).embeds.shape


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_batches_keep_each_requests_bytes_with_shared_encoding_on_gpu(pipe, cfg: bool) -> None:
    values = dict(negative_prompt=" ", width=64, height=64, num_inference_steps=4)
    values["true_cfg_scale"] = 4.0 if cfg else 1.0
    requests = [pipe.request(p, seed=seed, **values) for seed, p in enumerate([PROMPTS[0], EDGE, LONG])]

    def hashes(batch: list) -> list[str]:
        return [png_sha256(result.images[0]) for result in pipe.run(batch, slots=4)]

    alone = [hashes([r])[0] for r in requests]
    assert hashes(requests) == alone and hashes(requests[::-1])[::-1] == alone
    assert len(set(alone)) == 3


def test_served_batches_with_shared_encoding_answer_with_the_bytes_alone(pipe) -> None:
    pytest.importorskip("uvicorn")
    check_served_batches(pipe, [*PROMPTS, EDGE, LONG], 12, again=(0, 4, 5, 11))
