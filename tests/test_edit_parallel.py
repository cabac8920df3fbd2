"""Editing under CFG-parallel on two gloo ranks (what `--gpus 2` starts, on the CPU): each rank runs one CFG
branch of an Edit-2511-like checkpoint with two input images, and the edits are byte-identical PNGs to one
process at the same thread count (one thread, as the ranks run); with true CFG off both ranks run the
positive branch and give the same bytes too."""

import json
import sys
from pathlib import Path

import pytest
import torch
from edit_fixtures import build_edit_checkpoint, our_edit_pipeline
from helpers import RANK_SCRIPT, launch, png_sha256
from parallel_rank import EDIT_ARGS, edit_inputs
from PIL import Image

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_edit_checkpoint(
        tmp_path_factory.mktemp("edit-cfg") / "plus", "QwenImageEditPlusPipeline", True
    )


@pytest.mark.cpu_dtype
def test_cfg_parallel_edits_equal_one_process(checkpoint: Path, tmp_path: Path) -> None:
    result = launch(2, [sys.executable, RANK_SCRIPT, "edit-cfg", str(tmp_path), str(checkpoint)])
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert json.loads((tmp_path / "seen.json").read_text())["plan"].startswith("CFG-2 x Ulysses-1 on 2 ranks")
    pipe = our_edit_pipeline(checkpoint, dtype=None, variant="auto")  # what the ranks load
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count (helpers.rank_env): CPU kernels may depend on it
    try:
        one = {
            "cfg": pipe.generate("put 1 beside 2", image=edit_inputs(), **EDIT_ARGS),
            "nocfg": pipe.generate(
                "put 1 beside 2", image=edit_inputs(), **{**EDIT_ARGS, "negative_prompt": None}
            ),
        }
    finally:
        torch.set_num_threads(threads)
    for name, images in one.items():
        ranks = [png_sha256(Image.open(tmp_path / f"edit-cfg2-{name}-{i}.png")) for i in range(len(images))]
        assert ranks == [png_sha256(image) for image in images], name
    assert png_sha256(one["cfg"][0]) != png_sha256(one["nocfg"][0])
