"""GPU checks of request batching (pipelines/batching.py, ui/runner.py): on CUDA, with graphs and the FP8
fused path, a request's PNG is the same bytes alone and in any batch and slot at the server's fixed batch
size, and the HTTP server with batching on answers concurrent requests with those bytes."""

import pytest
import torch
from helpers import png_sha256

from pipelines import load_pipeline
from pipelines.batching import BatchPlan, BatchRequest, BatchSettings, encode, run_batch
from pipelines.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu
PROMPTS = [f"a red fox in the snow, picture {i}" for i in range(4)]


@pytest.fixture(scope="module")
def fp8_pipe(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8serve") / "model"
    directory = quantize_checkpoint(None, out, prompts=["a red fox"], steps=4, size=128, device="cuda")
    return load_pipeline(directory, device="cuda")


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_fixed_batches_keep_each_requests_bytes_on_gpu(fp8_pipe, cfg: bool) -> None:
    pipe = fp8_pipe
    assert pipe.variant == "fp8-fused" and pipe.cuda_graphs
    settings = BatchSettings(192, 128, 6, 4.0 if cfg else 1.0, true_cfg=cfg, num_images_per_prompt=2)
    requests = [BatchRequest(p, " ", seed) for seed, p in enumerate(PROMPTS[:3])]
    for request in requests:
        encode(pipe, request, settings)

    def hashes(batch: list[BatchRequest]) -> list[list[str]]:
        return [[png_sha256(im) for im in images] for images in run_batch(pipe, batch, settings, slots=4)[0]]

    alone = [hashes([r])[0] for r in requests]
    assert hashes(requests) == alone
    assert hashes(requests[::-1])[::-1] == alone
    assert len({h for pair in alone for h in pair}) == 6
    one = run_batch(pipe, [requests[0]], settings, slots=1)[0][0]
    generated = pipe.generate(
        PROMPTS[0], negative_prompt=" ", width=192, height=128, num_inference_steps=6, seed=0,
        true_cfg_scale=settings.true_cfg_scale, num_images_per_prompt=2,
    )  # fmt: skip
    assert [png_sha256(im) for im in one] == [
        png_sha256(im) for im in generated
    ]  # a batch of one is generate


def test_served_batches_answer_with_the_bytes_of_requests_alone(fp8_pipe) -> None:
    pytest.importorskip("uvicorn")
    import base64
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from ui.limits import Limits
    from ui.runner import Runner
    from ui.server import InThread, build_server

    runner = Runner(fp8_pipe, Limits.for_device("cuda"), BatchPlan.for_device(fp8_pipe.device, 4))
    server = InThread(build_server(fp8_pipe, runner))
    try:

        def ask(i: int) -> bytes:
            body = {"prompt": PROMPTS[i % 4], "size": "128x128", "seed": i, "num_inference_steps": 4}
            response = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
            return base64.b64decode(response.json()["data"][0]["b64_json"])

        with ThreadPoolExecutor(12) as pool:
            together = list(pool.map(ask, range(12)))
        assert runner.counters.batch_requests == 12 and runner.counters.batches < 12
        assert [ask(i) for i in (0, 5, 11)] == [together[i] for i in (0, 5, 11)]
    finally:
        server.close()
        runner.close()


def test_memory_bounds_the_batch(fp8_pipe) -> None:
    plan = BatchPlan.for_device(fp8_pipe.device, 1000)
    free, _ = torch.cuda.mem_get_info(fp8_pipe.device)
    assert 0 < plan.memory_bytes <= free
    huge = BatchSettings(2048, 2048, 4, 1.0, False)
    assert 1 <= plan.slots(huge) < 1000
