"""Qwen-Image 2.1 under GPU-memory placements on CUDA (issue 24): the tiny checkpoint of
tests/qi21_checkpoints.py with four blocks (more than the two slots they stream through), quantized on CUDA
with every block linear in FP8, gives the resident pipeline's PNG bytes with its blocks streamed, the cached
target steps captured in CUDA graphs with their copies and replayed, eagerly too, KV cache on and off; under
the plan the model keeps one KV cache per CFG branch.
"""

import pytest
import torch
from edit_fixtures import drawn_image
from helpers import png_sha256
from memory_fixtures import placed_pipeline
from qi21_checkpoints import RESOLUTION, build_qi21_checkpoint

from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION
from qwen_image_fusion.models.streaming import CudaLink
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.precision import Precision
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
GPU = Precision(torch.bfloat16, torch.bfloat16, "what load_pipeline picks on CUDA")
REQUEST = dict(
    prompt="make it snow",
    image=drawn_image(160, 96, seed=3, mode="RGBA"),
    negative_prompt="blurry",
    true_cfg_scale=3.0,
    num_inference_steps=4,
    seed=4,
)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qi21memgpu")
    bf16 = build_qi21_checkpoint(root / "bf16", num_layers=4)
    every_block = QUANTIZATION.all_blocks_fp8
    args = dict(steps=3, size=64, device="cuda")
    return quantize_checkpoint(bf16, root / "fp8", ["a red fox"], every_block, **args)


def shas(pipe, cache: bool) -> list[str]:
    pipe.model.resolution, pipe.model.use_kv_cache = RESOLUTION, cache
    return [png_sha256(image) for image in pipe.generate(**REQUEST)]


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize(("text", "blocks", "lend"), [(("offload", 0), 0, False), (("offload", 1), 1, True)])
def test_streamed_2_1_equals_resident_with_graphs_and_eager(fp8_dir, cache, text, blocks, lend):
    expected = shas(load_pipeline(fp8_dir, variant="fp8-fused", device="cuda"), cache)
    pipe = placed_pipeline(fp8_dir, "fp8-fused", text, blocks, CudaLink(CUDA), precision=GPU, lend=lend)
    assert pipe.cuda_graphs and pipe.memory.plan.placement("transformer").streamed
    assert shas(pipe, cache) == expected
    assert pipe._graphed.graphs, "the streamed step was captured with its copies"
    assert shas(pipe, cache) == expected  # replays
    if cache:
        assert len(pipe.model.planner.slots) == pipe.memory.plan.calls_per_step == 2
    pipe.cuda_graphs = False
    assert shas(pipe, cache) == expected
