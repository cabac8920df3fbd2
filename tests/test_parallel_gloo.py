"""Several ranks on the CPU (gloo, processes started by the tests): CFG-parallel images byte-identical to
one process, Ulysses images against one process, FP8 fused vs unfused under Ulysses, CFG-2 x Ulysses-2
on four ranks, and the web demo's leader and followers."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import RANK_SCRIPT, launch, png_sha256
from parallel_rank import BF16, CACHED, CFG_ON, PROMPTS, SIZE
from PIL import Image

from qwen_image_fusion.eval.metrics import abs_diff, psnr
from qwen_image_fusion.pipelines import load_pipeline

pytestmark = pytest.mark.slow
# Ulysses on the CPU: measured byte-identical to one process (the keys keep the one-process order and
# the CPU GEMMs do not depend on the row count); the bound allows another CPU's GEMM blocking
ULYSSES_MAX_ABS, ULYSSES_MIN_PSNR = 4, 40.0


@pytest.fixture(scope="module")
def bf16_pipe():
    return load_pipeline(device="cpu", **BF16)


@pytest.fixture(scope="module")
def one_process(fp8_dir, bf16_pipe) -> dict[str, list]:
    """The images of one process for every comparison (and the cached run's step-cache line)."""
    fp8 = load_pipeline(fp8_dir, device="cpu")
    images = {
        "bf16-cfg": bf16_pipe.generate(PROMPTS, **CFG_ON),
        "bf16-nocfg": bf16_pipe.generate(PROMPTS, **SIZE),
        "bf16-cached": bf16_pipe.generate(PROMPTS, **CACHED),
    }
    return images | {
        "bf16-cached-run": [bf16_pipe.last_run.cache.summary()],
        "fp8-fused-cfg": fp8.generate(PROMPTS, **CFG_ON),
    }


def read(out: Path, name: str) -> list[Image.Image]:
    return [Image.open(out / f"{name}-{i}.png") for i in range(len(PROMPTS))]


def hashes(images: list[Image.Image]) -> list[str]:
    return [png_sha256(im) for im in images]


def closeness(images: list[Image.Image], reference: list[Image.Image]) -> tuple[int, float]:
    """(max |diff| over 0..255, lowest PSNR in dB) of image pairs."""
    pairs = [
        (np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB")))
        for a, b in zip(images, reference, strict=True)
    ]
    return max(int(abs_diff(a, b).max()) for a, b in pairs), min(psnr(a, b) for a, b in pairs)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, fp8_dir) -> Path:
    out = tmp_path_factory.mktemp("two")
    result = launch(2, [sys.executable, RANK_SCRIPT, "two", str(out), str(fp8_dir)])
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return out


@pytest.mark.cpu_dtype
def test_cfg_parallel_is_byte_identical_to_one_process(two_ranks, one_process):
    assert hashes(read(two_ranks, "bf16-cfg2-cfg")) == hashes(one_process["bf16-cfg"])
    assert hashes(read(two_ranks, "fp8-fused-cfg2-cfg")) == hashes(one_process["fp8-fused-cfg"])
    # true CFG off under a CFG-2 plan: both CFG ranks run the positive branch, same bytes as one process
    assert hashes(read(two_ranks, "bf16-cfg2-nocfg")) == hashes(one_process["bf16-nocfg"])
    # with a step cache each CFG rank keeps its branch's cache: the same steps skipped, the same bytes
    assert hashes(read(two_ranks, "bf16-cfg2-cached")) == hashes(one_process["bf16-cached"])
    assert one_process["bf16-cached-run"] == [
        "always: middle blocks skipped in 3 of 6 (positive), 3 of 6 (negative) steps"
    ]


def test_a_cfg_rank_reports_its_branch_and_ulysses_refuses_a_step_cache(two_ranks):
    seen = json.loads((two_ranks / "seen.json").read_text())
    # rank 0 ran the positive branch only, and says so
    assert seen["cfg2_cached_run"] == "always: middle blocks skipped in 3 of 6 (positive) steps"
    assert seen["ulysses_cache"].startswith("a step cache is not built for Ulysses sequence parallelism")


def test_ulysses_is_close_to_one_process(two_ranks, one_process):
    for name in ("bf16-cfg", "bf16-nocfg"):
        max_abs, worst_psnr = closeness(read(two_ranks, f"bf16-u2-{name[5:]}"), one_process[name])
        print(f"Ulysses-2 {name} vs one process: max |diff| {max_abs}, PSNR {worst_psnr:.1f} dB")
        assert max_abs <= ULYSSES_MAX_ABS and worst_psnr >= ULYSSES_MIN_PSNR
    max_abs, worst_psnr = closeness(read(two_ranks, "fp8-fused-u2-cfg"), one_process["fp8-fused-cfg"])
    print(f"Ulysses-2 fp8-fused vs one process: max |diff| {max_abs}, PSNR {worst_psnr:.1f} dB")
    assert max_abs <= ULYSSES_MAX_ABS and worst_psnr >= ULYSSES_MIN_PSNR


def test_fp8_fused_and_unfused_stay_identical_under_ulysses(two_ranks):
    assert hashes(read(two_ranks, "fp8-fused-u2-cfg")) == hashes(read(two_ranks, "fp8-unfused-u2-cfg"))


def test_sharded_step_has_no_host_sync(two_ranks):
    assert json.loads((two_ranks / "seen.json").read_text())["no_host_sync"]


def test_a_sequence_too_short_to_split_is_refused_on_every_rank(two_ranks):
    seen = json.loads((two_ranks / "seen.json").read_text())
    assert "1 text and 12 image tokens cannot be split over 2 ranks" in seen["one_text_token"]


def test_web_demo_followers_stop_and_fail_with_the_leader(two_ranks, bf16_pipe):
    seen = json.loads((two_ranks / "seen.json").read_text())
    assert seen["stopped"] and "prompt is empty" in seen["refused"]
    first = bf16_pipe.generate(PROMPTS[0], **CFG_ON)
    last = bf16_pipe.generate(PROMPTS[1], **{**CFG_ON, "seed": seen["last_seed"]})
    assert png_sha256(Image.open(two_ranks / "demo-first-0.png")) == png_sha256(first[0])
    assert png_sha256(Image.open(two_ranks / "demo-last-0.png")) == png_sha256(last[0])


@pytest.mark.cpu_dtype
def test_cfg2_x_ulysses2_on_four_ranks(tmp_path, fp8_dir, two_ranks, one_process):
    result = launch(4, [sys.executable, RANK_SCRIPT, "four", str(tmp_path), str(fp8_dir)])
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert json.loads((tmp_path / "seen.json").read_text())["plan"].startswith("CFG-2 x Ulysses-2 on 4 ranks")
    # each Ulysses pair runs one branch exactly as the Ulysses-2 plan runs it
    for name in ("cfg", "nocfg"):
        assert hashes(read(tmp_path, f"bf16-c2u2-{name}")) == hashes(read(two_ranks, f"bf16-u2-{name}"))
    assert hashes(read(tmp_path, "fp8-fused-c2u2-cfg")) == hashes(read(tmp_path, "fp8-unfused-c2u2-cfg"))
    assert hashes(read(tmp_path, "fp8-fused-c2u2-cfg")) == hashes(read(two_ranks, "fp8-fused-u2-cfg"))
    max_abs, worst_psnr = closeness(read(tmp_path, "bf16-c2u2-cfg"), one_process["bf16-cfg"])
    assert max_abs <= ULYSSES_MAX_ABS and worst_psnr >= ULYSSES_MIN_PSNR
