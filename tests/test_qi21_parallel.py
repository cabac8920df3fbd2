"""Qwen-Image 2.1 on two gloo ranks (CPU): CFG-parallel images byte-identical to one process at the ranks' one
thread, with a condition image and the KV cache on and off (each rank caches its own branch's prefix); a
Ulysses plan is refused in one line on every rank."""

import json
import sys

import pytest
import torch
from helpers import RANK_SCRIPT, launch, png_sha256
from parallel_rank import QI21_PROMPTS, qi21_args
from PIL import Image
from qi21_checkpoints import RESOLUTION, build_qi21_checkpoint

from qwen_image_fusion.pipelines import load_pipeline

pytestmark = pytest.mark.slow


def test_cfg_parallel_is_byte_identical_to_one_process(tmp_path):
    model = build_qi21_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "ranks"
    out.mkdir()
    result = launch(2, [sys.executable, RANK_SCRIPT, "qi21", str(out), str(model)])
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    seen = json.loads((out / "seen.json").read_text())
    assert seen["plan"].startswith("CFG-2 x Ulysses-1 on 2 ranks")
    assert "Ulysses sequence parallelism is not built for the qwen-image-2.1 family" in seen["ulysses"]

    pipe = load_pipeline(model, variant="reference", device="cpu", dtype="fp32")
    pipe.model.resolution = RESOLUTION
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run one thread each (helpers.rank_env)
    try:
        for cache in ("cache", "nocache"):
            pipe.model.use_kv_cache = cache == "cache"
            one = [png_sha256(im) for im in pipe.generate(QI21_PROMPTS, **qi21_args())]
            ranks = [png_sha256(Image.open(out / f"qi21-cfg2-{cache}-{i}.png")) for i in range(len(one))]
            assert ranks == one, cache
    finally:
        torch.set_num_threads(threads)
