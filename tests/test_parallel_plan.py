"""The parallel plan and its pieces without ranks: plans from world sizes, refusals before anything loads
(CLI and API), the Ulysses row split, CFG branches per rank, CUDA-graph segments cut at collectives."""

import json
import os
import shutil

import pytest
import torch
from helpers import REPO

from qwen_image_fusion.models.embedded import DEFAULT_MODEL_DIR
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import Conditioning
from qwen_image_fusion.models.sequence_parallel import (
    Shards,
    cut_at_collectives,
    first_words,
    row_parts,
    run_collective,
)
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.cuda_graph import GraphSegments
from qwen_image_fusion.pipelines.parallel import ParallelPlan, counts_that_fit, plan_for, resolve_plan
from qwen_image_fusion.pipelines.sampling import branch_velocities
from qwen_image_fusion.ui.cli import main
from qwen_image_fusion.ui.launch import RanksFailed

QWEN_IMAGE_HEADS = 24


@pytest.mark.parametrize(
    ("gpus", "true_cfg", "cfg", "ulysses"),
    [
        (1, True, 1, 1),
        (2, True, 2, 1),
        (2, False, 1, 2),
        (3, True, 1, 3),
        (4, True, 2, 2),
        (4, False, 1, 4),
        (6, True, 2, 3),
        (8, True, 2, 4),
        (48, True, 2, 24),
    ],
)
def test_plan_from_the_world_size(gpus, true_cfg, cfg, ulysses):
    plan = plan_for(gpus, QWEN_IMAGE_HEADS, true_cfg)
    assert (plan.cfg, plan.ulysses, plan.world_size) == (cfg, ulysses, gpus)


@pytest.mark.parametrize(
    ("gpus", "true_cfg", "message"),
    [
        (5, True, "the Ulysses degree would be 5, which does not divide the model's 24 attention heads"),
        (10, True, "the Ulysses degree after CFG-2 would be 5"),
        (16, False, "the Ulysses degree would be 16"),
        (0, True, "0 GPUs: give a positive count"),
    ],
)
def test_plans_that_do_not_fit_are_refused(gpus, true_cfg, message):
    with pytest.raises(InputError, match=message):
        plan_for(gpus, QWEN_IMAGE_HEADS, true_cfg)


def test_the_refusal_lists_the_counts_that_fit_and_so_does_the_gpu_guide():
    with pytest.raises(
        InputError, match=r"counts that fit \(with true CFG\): 1, 2, 3, 4, 6, 8, 12, 16, 24, 48$"
    ):
        plan_for(5, QWEN_IMAGE_HEADS, True)
    listed = ", ".join(map(str, counts_that_fit(QWEN_IMAGE_HEADS, true_cfg=True)))
    assert f"attention heads (24 for Qwen-Image): {listed} GPUs fit with true CFG" in " ".join(
        (REPO / "docs" / "gpu.md").read_text().split()
    )


def test_degrees_out_of_range_are_refused():
    with pytest.raises(InputError, match="CFG degree 3 must be 1 or 2"):
        ParallelPlan(cfg=3)
    with pytest.raises(InputError, match="Ulysses degree 0"):
        ParallelPlan(ulysses=0)


def _checkpoint_config(tmp_path, heads: int):
    """The embedded default's configs (weights linked) with a transformer of `heads` heads x 40 channels."""
    copy = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, copy, copy_function=os.symlink)
    path = copy / "transformer" / "config.json"
    config = json.loads(path.read_text())
    path.unlink()
    config.update(num_attention_heads=heads, attention_head_dim=40, axes_dims_rope=[8, 16, 16])
    path.write_text(json.dumps(config))
    return copy


def test_heads_come_from_the_checkpoint_config_before_loading(tmp_path):
    model = _checkpoint_config(tmp_path, heads=20)
    assert resolve_plan(ParallelPlan(ulysses=4), model) == ParallelPlan(ulysses=4)
    with pytest.raises(InputError, match="Ulysses degree of 3 does not divide the model's 20 attention"):
        resolve_plan(ParallelPlan(ulysses=3), model)


def test_auto_plans_for_the_launched_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_plan("auto", None) == ParallelPlan(cfg=2, ulysses=2)  # the embedded model has 2 heads
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_plan("auto", None) is None
    with pytest.raises(InputError, match="give None, 'auto' or a ParallelPlan"):
        resolve_plan("cfg", None)


def test_a_plan_needs_ranks(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(InputError, match="a parallel plan needs ranks"):
        load_pipeline(device="cpu", parallel=ParallelPlan(cfg=2))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "fox", "--gpus", "2", "--device", "cpu"], "for gloo ranks on the CPU run `torchrun"),
        (["generate", "fox", "--gpus", "3", "--negative-prompt", " "], "no parallel plan for 3 GPUs"),
        (["ui", "--gpus", "4"], "--gpus 4, but 0 CUDA GPUs are visible"),
    ],
)
def test_cli_refuses_a_plan_before_loading(args, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "loading" not in err


def test_cli_refuses_gpus_unlike_the_launched_ranks(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["generate", "fox", "--gpus", "4"]) == 2
    assert "--gpus 4, but the launcher started 2 ranks" in capsys.readouterr().err


@pytest.mark.cpu_dtype
def test_info_shows_the_plans(capsys):
    heads = load_pipeline(device="cpu").transformer.config.num_attention_heads
    gpus = 2 * heads  # CFG-2 x Ulysses-heads fits; Ulysses over all of them does not divide the heads
    assert main(["info", "--device", "cpu", "--gpus", str(gpus)]) == 0
    out = capsys.readouterr().out
    assert "parallel: one process" in out
    assert f"--gpus {gpus} with true CFG on: CFG-2 x Ulysses-{heads} on {gpus} ranks" in out
    assert f"--gpus {gpus} with true CFG off: none (no parallel plan for {gpus} GPUs" in out


def test_rows_split_in_nearly_equal_contiguous_parts():
    assert row_parts(7, 2) == (4, 3)
    assert row_parts(4096, 4) == (1024,) * 4
    assert row_parts(10, 4) == (3, 3, 2, 2)


def test_keys_return_to_the_one_process_order():
    """After the all-to-all the rows are [text 0, image 0, text 1, image 1]; the key ranges put them back
    as [text 0, text 1, image 0, image 1]."""
    shards = Shards(group=None, rank=0, text=(3, 2), image=(4, 4))
    rows = torch.tensor([0, 1, 2, 10, 11, 12, 13, 3, 4, 14, 15, 16, 17])  # text rows < 10, image rows >= 10
    order = torch.cat([rows[r] for r in shards.key_ranges()])
    assert order.tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17]
    assert shards.rows == [7, 6]
    assert shards.text_slice() == slice(0, 3) and shards.image_slice() == slice(0, 4)


class FakeCfg:
    """A CFG exchange of `size` ranks seen from `rank`: gather returns every rank's branch velocity."""

    def __init__(self, rank: int, size: int = 2) -> None:
        self.rank, self.size, self.gathered = rank, size, []

    def gather(self, velocity):
        self.gathered.append(velocity)
        return [torch.full_like(velocity, r) for r in range(self.size)]


def test_each_cfg_rank_runs_its_own_branch_and_a_single_branch_runs_everywhere():
    branches = [Conditioning(torch.full((1, 2, 3), float(i)), None) for i in range(2)]
    calls = []

    def step(latents, branch, sigma):
        calls.append(branch.embeds[0, 0, 0].item())
        return latents + branch.embeds[0, 0, 0]

    latents, sigma = torch.zeros(1, 4), torch.ones(1)
    cfg = FakeCfg(rank=1)
    velocities = branch_velocities(step, latents, sigma, branches, cfg)
    assert calls == [1.0] and len(cfg.gathered) == 1 and [v[0, 0].item() for v in velocities] == [0, 1]
    calls.clear()
    branch_velocities(step, latents, sigma, branches[:1], cfg)  # true CFG off: the positive branch only
    assert calls == [0.0] and len(cfg.gathered) == 1
    calls.clear()
    branch_velocities(step, latents, sigma, branches)  # one process: both, positive first
    assert calls == [0.0, 1.0]


class FakeGraph:
    """Records capture and replay calls in a shared log."""

    count = 0

    def __init__(self, log: list) -> None:
        FakeGraph.count += 1
        self.name, self.log = f"g{FakeGraph.count}", log

    def capture_begin(self, pool, capture_error_mode):
        self.log.append(f"begin {self.name} pool={pool} mode={capture_error_mode}")

    def capture_end(self):
        self.log.append(f"end {self.name}")

    def replay(self):
        self.log.append(f"replay {self.name}")


def _step_with_two_collectives(log: list) -> torch.Tensor:
    for name in ("a2a", "gather"):
        log.append(f"kernels before {name}")
        run_collective(lambda name=name: log.append(f"run {name}"), name, 2)
    return torch.ones(1)


def test_graph_segments_cut_at_collectives_and_run_them_between_replays():
    log: list[str] = []
    FakeGraph.count = 0
    segments = GraphSegments(lambda: FakeGraph(log), pool="P", capture_error_mode="thread_local")
    assert torch.equal(segments.capture(lambda: _step_with_two_collectives(log)), torch.ones(1))
    assert log == [
        "begin g1 pool=P mode=thread_local",
        "kernels before a2a",
        "end g1",
        "begin g2 pool=P mode=thread_local",
        "kernels before gather",
        "end g2",
        "begin g3 pool=P mode=thread_local",
        "end g3",
    ]  # nothing collective ran during the capture
    log.clear()
    segments.replay()
    assert log == ["replay g1", "run a2a", "replay g2", "run gather", "replay g3"]


def test_graph_without_cuts_keeps_the_collectives_inside():
    log: list[str] = []
    FakeGraph.count = 0
    segments = GraphSegments(lambda: FakeGraph(log), pool="P")
    segments.capture(lambda: _step_with_two_collectives(log), cut=False)
    assert [line for line in log if line.startswith(("begin", "run"))] == [
        "begin g1 pool=P mode=global",
        "run a2a",
        "run gather",
    ]
    log.clear()
    segments.replay()
    assert log == ["replay g1"]


def test_cuts_end_with_their_context():
    log: list[str] = []
    with cut_at_collectives(lambda op: log.append("cut")):
        run_collective(lambda: log.append("run"), "x", 2)
    run_collective(lambda: log.append("run"), "x", 2)
    assert log == ["cut", "run"]


def test_a_killed_rank_is_named():
    assert str(RanksFailed(1, -9)).startswith("rank 1 was killed by signal 9")
    assert str(RanksFailed(0, 3)).startswith("rank 0 exited with status 3")


def test_a_backend_error_is_cut_to_its_gist():
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:41689: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs."
    )
    assert first_words(gloo) == "Read error [127.0.0.1]:41689: Connection reset by peer"
    assert first_words(RuntimeError("")) == "RuntimeError"
