"""GPU checks of request batching (`Pipeline.run`, ui/runner.py): on CUDA, with graphs and the FP8
fused path, a request's PNG is the same bytes alone and in any batch and slot at the server's fixed batch
size, and the HTTP server with batching on answers concurrent requests with those bytes."""

import os

import pytest
import torch
from helpers import check_served_batches, png_sha256

from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.batching import BatchPlan
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

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
    values = dict(
        negative_prompt=" ", width=192, height=128, num_inference_steps=6, true_cfg_scale=4.0 if cfg else 1.0,
        num_images_per_prompt=2,
    )  # fmt: skip
    requests = [pipe.request(p, seed=seed, **values) for seed, p in enumerate(PROMPTS[:3])]
    assert requests[0].true_cfg == cfg

    def hashes(batch: list) -> list[list[str]]:
        return [[png_sha256(im) for im in result.images] for result in pipe.run(batch, slots=4)]

    alone = [hashes([r])[0] for r in requests]
    assert hashes(requests) == alone
    assert hashes(requests[::-1])[::-1] == alone
    assert len({h for pair in alone for h in pair}) == 6


def test_served_batches_answer_with_the_bytes_of_requests_alone(fp8_pipe) -> None:
    pytest.importorskip("uvicorn")
    check_served_batches(fp8_pipe, PROMPTS, 12, again=(0, 5, 11))


def test_memory_bounds_the_batch(fp8_pipe) -> None:
    plan = BatchPlan.for_device(fp8_pipe.device, 1000, planned=False)
    free, _ = torch.cuda.mem_get_info(fp8_pipe.device)
    assert 0 < plan.memory_bytes <= free
    huge = fp8_pipe.request("x", width=2048, height=2048, num_inference_steps=4, seed=0)
    assert 1 <= plan.slots(huge) < 1000
    assert BatchPlan.for_device(fp8_pipe.device, 1000, planned=True).slots(huge) == 1000  # the plan bounds it


FULL_SIZE = os.environ.get("QWEN_IMAGE_GPU_CHECKPOINT")


@pytest.mark.skipif(FULL_SIZE is None, reason="set QWEN_IMAGE_GPU_CHECKPOINT to a full-size FP8 checkpoint")
def test_served_batches_under_a_24_gib_plan_keep_each_requests_bytes() -> None:
    """The server's path under a memory plan at full size: loaded for 24 GiB holding four 512x512 rows
    (blocks streamed), four concurrent requests batch through `Pipeline.run` inside the plan, under the cap;
    each response equals the same request served alone at that budget and with everything resident."""
    import base64
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from bench.in_thread import InThread
    from qwen_image_fusion.models.memory import Workload
    from qwen_image_fusion.ui.limits import Limits
    from qwen_image_fusion.ui.runner import Runner
    from qwen_image_fusion.ui.server import build_server

    largest = Workload(512, 512, images=4, prompts=4)  # as `serve --max-batch 4` plans (shared encoding)
    pipe = load_pipeline(FULL_SIZE, device="cuda", gpu_memory="24GiB", workload=largest)
    assert pipe.memory.plan.placement("transformer").streamed, pipe.memory.plan.summary()
    runner = Runner(pipe, Limits.for_device("cuda"), BatchPlan.for_device(pipe.device, 4, planned=True), 1.0)
    server = InThread(build_server(pipe, runner))

    def ask(i: int) -> bytes:
        body = {"prompt": PROMPTS[i], "size": "512x512", "seed": i, "num_inference_steps": 4}
        body["negative_prompt"] = " "  # true CFG: two transformer calls a step
        response = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return base64.b64decode(response.json()["data"][0]["b64_json"])

    try:
        torch.cuda.reset_peak_memory_stats()
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, range(4)))
        peak = torch.cuda.max_memory_reserved() / 2**30
        assert runner.counters.batches < 4 and runner.counters.batch_requests == 4
        alone = [ask(i) for i in range(4)]
        pipe.set_gpu_memory(None)
        assert pipe.memory.plan.resident
        resident = [ask(i) for i in range(4)]
    finally:
        server.close()
        runner.close()
        torch.cuda.set_per_process_memory_fraction(1.0)
    print(f"peak {peak:.1f} GiB; {runner.counters.batches} batches for 4 concurrent requests")
    assert peak <= 24, peak
    assert together == alone == resident and len(set(together)) == 4
