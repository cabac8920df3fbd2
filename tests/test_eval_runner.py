"""qwen_image_fusion.eval.runner: the pair list, its round-robin shards, and a worker that dies."""

import shutil

import pytest

from qwen_image_fusion.eval import runner
from qwen_image_fusion.eval.variants import VariantSpec


def test_jobs_cover_prompt_x_seed_and_shards_partition_them() -> None:
    jobs = runner.make_jobs(["a cat", "一只狗", "a bird"], [0, 7])
    assert [(j.index, j.id, j.prompt, j.seed) for j in jobs[:3]] == [
        (0, "p000-s0", "a cat", 0),
        (1, "p000-s7", "a cat", 7),
        (2, "p001-s0", "一只狗", 0),
    ]
    shards = [runner.shard(jobs, rank, 4) for rank in range(4)]
    assert sorted(j.index for s in shards for j in s) == list(range(6))
    assert [j.index for j in shards[1]] == [1, 5]


def test_worker_env_leaves_torchrun_and_pins_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    env = runner.worker_env("3")
    assert "WORLD_SIZE" not in env and "TORCHELASTIC_RUN_ID" not in env and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in runner.worker_env(None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert runner.worker_env(None)["CUDA_VISIBLE_DEVICES"] == "1,2"  # no GPU of its own: the parent's stand
    assert runner.worker_env("2")["CUDA_VISIBLE_DEVICES"] == "2"


def test_a_dead_worker_is_reported_as_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner.sys, "executable", shutil.which("false"))  # exits 1 at once, says nothing
    worker = runner.Worker(
        "b", VariantSpec(text="contract:cpu", name="contract", device="cpu"), None, runner.worker_env(None)
    )
    with pytest.raises(runner.WorkerCrash, match=r"variant b \(contract:cpu\): worker exited with status 1"):
        worker.receive()
    worker.close()
