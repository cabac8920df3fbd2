"""Several GPUs: the parallel plan (a CFG degree times a Ulysses degree), its process groups, and the
exchanges the pipeline and the UI need across ranks.

A plan comes from the world size: CFG degree 2 when true CFG is on and the world size is even (each CFG
rank runs one branch, the velocities are all-gathered), times a Ulysses degree for the rest (the joint
sequence split over that many ranks, models/sequence_parallel.py), which must divide the attention heads.
A request with true CFG off under a CFG-2 plan runs the positive branch on both CFG ranks: the same
bytes as with CFG parallelism off, no speed-up from the CFG ranks (launch with a plan without CFG, e.g.
`qwen-image generate --gpus 2` with no negative prompt, for CFG-off work).

Rank layout: rank = cfg_rank * ulysses + ulysses_rank, so the ranks of one Ulysses group are neighbours
(the all-to-all traffic stays between adjacent GPUs); each CFG group holds one rank of every Ulysses group.
Collectives time out after QWEN_IMAGE_COLLECTIVE_TIMEOUT seconds (default 600); a failed one raises
ParallelError on the ranks that see it, and the launcher (`qwen-image --gpus`, torchrun) stops the others.
"""

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.family import CheckpointSpec
from qwen_image_fusion.models.sequence_parallel import (
    SequenceParallel,
    all_gather,
    run_collective,
    shard_sequence,
)
from qwen_image_fusion.pipelines.launch_env import LEADER_RANK, launched_world_size

TIMEOUT_ENV = "QWEN_IMAGE_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
IDLE_TIMEOUT = datetime.timedelta(days=365)  # followers of the web demo wait this long for the next job


@dataclass(frozen=True)
class ParallelPlan:
    """How the ranks share one image: `cfg` ranks per CFG pair (1 or 2) times `ulysses` sequence shards."""

    cfg: int = 1
    ulysses: int = 1

    def __post_init__(self) -> None:
        if self.cfg not in (1, 2):
            raise InputError(f"CFG degree {self.cfg} must be 1 or 2 (one rank per CFG branch)")
        if not isinstance(self.ulysses, int) or self.ulysses < 1:
            raise InputError(f"Ulysses degree {self.ulysses} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses

    def describe(self) -> str:
        return f"CFG-{self.cfg} x Ulysses-{self.ulysses} on {self.world_size} ranks"

    def check_heads(self, heads: int) -> None:
        """InputError unless the Ulysses degree divides the attention heads."""
        if heads % self.ulysses:
            raise InputError(
                f"{self.describe()}: a Ulysses degree of {self.ulysses} does not divide the model's "
                f"{heads} attention heads"
            )


def plan_for(world_size: int, heads: int, true_cfg: bool = True) -> ParallelPlan:
    """The plan for `world_size` ranks: CFG-2 when true CFG is on and the count is even, Ulysses for the
    rest. InputError naming the counts that fit when the Ulysses degree would not divide the heads."""
    if not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"{world_size} GPUs: give a positive count")
    cfg = 2 if true_cfg and world_size % 2 == 0 else 1
    plan = ParallelPlan(cfg, world_size // cfg)
    if heads % plan.ulysses:
        fits = counts_that_fit(heads, true_cfg)
        split = "after CFG-2 " if cfg == 2 else ""
        raise InputError(
            f"no parallel plan for {world_size} GPUs: the Ulysses degree {split}would be {plan.ulysses}, "
            f"which does not divide the model's {heads} attention heads; counts that fit "
            f"({'with' if true_cfg else 'without'} true CFG): {', '.join(map(str, fits))}"
        )
    return plan


def counts_that_fit(heads: int, true_cfg: bool) -> list[int]:
    """Every GPU count with a plan for a model of `heads` attention heads (at most 2 x heads with CFG-2)."""
    return [n for n in range(1, 2 * heads + 1) if _fits(n, heads, true_cfg)]


def _fits(world_size: int, heads: int, true_cfg: bool) -> bool:
    cfg = 2 if true_cfg and world_size % 2 == 0 else 1
    return heads % (world_size // cfg) == 0


def check_supported(plan: ParallelPlan, spec: CheckpointSpec) -> None:
    """InputError when `plan` splits the sequence of a model whose family has no Ulysses plan."""
    if plan.ulysses > 1 and not spec.sequence_parallel:
        raise InputError(
            f"{plan.describe()}: Ulysses sequence parallelism is not built for the {spec.family.name} "
            "family; run true CFG on 2 GPUs (CFG-parallel) or on one GPU"
        )


def resolve_plan(parallel: ParallelPlan | str | None, model: str | Path | None) -> ParallelPlan | None:
    """The plan `load_pipeline(parallel=...)` asks for, checked against the model's configs before loading:
    None for one process, "auto" for the launched world size with true CFG, or a ParallelPlan."""
    if parallel is None:
        return None
    spec = inspect_checkpoint(model)
    if parallel == "auto":
        plan = plan_for(launched_world_size(), spec.attention_heads)
    elif isinstance(parallel, ParallelPlan):
        plan = parallel
        plan.check_heads(spec.attention_heads)
    else:
        raise InputError(f"parallel={parallel!r}: give None, 'auto' or a ParallelPlan")
    check_supported(plan, spec)
    return None if plan.world_size == 1 else plan


def collective_timeout() -> datetime.timedelta:
    """QWEN_IMAGE_COLLECTIVE_TIMEOUT seconds (default 600): how long a collective waits for the others."""
    text = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise InputError(f"{TIMEOUT_ENV}={text!r} must be a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def join_ranks(device: torch.device) -> torch.device:
    """Join the launcher's process group (NCCL on GPUs, gloo on CPU) unless already joined; returns this
    rank's device (GPU LOCAL_RANK for CUDA)."""
    if not dist.is_initialized() and "RANK" not in os.environ:
        raise InputError(
            "a parallel plan needs ranks: run with `qwen-image ... --gpus N` or under "
            "`torchrun --nproc_per_node N`"
        )
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise InputError(
                f"local rank {local_rank} needs GPU {local_rank}, but {torch.cuda.device_count()} are visible"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(backend, timeout=collective_timeout(), device_id=device_id)
    return device


def leave_ranks() -> None:
    """Leave the process group after a run that ended well (NCCL warns at exit otherwise)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class CfgExchange:
    """The CFG group of this rank: rank i runs branch i, then every rank gets both velocities."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def gather(self, velocity: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's velocity [B, ...], in CFG-rank order (positive first), the same bytes on all ranks."""
        velocity = velocity.contiguous()
        gathered = velocity.new_empty(self.size * velocity.shape[0], *velocity.shape[1:])
        run_collective(lambda: all_gather(gathered, velocity, self.group), "CFG gather", self.size)
        return list(gathered.chunk(self.size))


class Ranks:
    """This process's part in a plan: its rank, its CFG exchange, the Ulysses hooks on the transformer, and
    two gloo groups over all ranks for the web demo's jobs and stop flags and for seeds."""

    def __init__(self, plan: ParallelPlan, transformer: torch.nn.Module) -> None:
        world = dist.get_world_size()
        if plan.world_size != world:
            raise InputError(f"{plan.describe()} needs {plan.world_size} ranks, but {world} were started")
        plan.check_heads(transformer.config.num_attention_heads)
        self.plan = plan
        self.rank = dist.get_rank()
        self.cfg_rank, ulysses_rank = divmod(self.rank, plan.ulysses)
        timeout = collective_timeout()
        # every rank creates every group, in the same order (torch.distributed requires it)
        self.cfg: CfgExchange | None = None
        for u in range(plan.ulysses if plan.cfg > 1 else 0):
            group = dist.new_group([c * plan.ulysses + u for c in range(plan.cfg)], timeout=timeout)
            if u == ulysses_rank:
                self.cfg = CfgExchange(group, self.cfg_rank, plan.cfg)
        self.sequence: SequenceParallel | None = None
        for c in range(plan.cfg if plan.ulysses > 1 else 0):
            group = dist.new_group([c * plan.ulysses + u for u in range(plan.ulysses)], timeout=timeout)
            if c == self.cfg_rank:
                self.sequence = shard_sequence(transformer, group)
        self.steps = dist.new_group(backend="gloo", timeout=timeout)
        self.jobs = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that writes files, prints and serves the web demo."""
        return self.rank == LEADER_RANK

    def describe(self) -> str:
        return f"{self.plan.describe()} (this is rank {self.rank})"

    def release(self) -> None:
        """Take the Ulysses hooks off the transformer (when the pipeline switches plans)."""
        if self.sequence is not None:
            self.sequence.remove()

    def share(self, value: object) -> object:
        """Rank 0's `value` on every rank (pickled over gloo; waits as long as a web demo idles)."""
        box = [value]
        dist.broadcast_object_list(box, src=LEADER_RANK, group=self.jobs)
        return box[0]

    def share_seed(self, seed: int) -> int:
        """Rank 0's seed on every rank, so a random seed is the same everywhere."""
        box = [seed]
        dist.broadcast_object_list(box, src=LEADER_RANK, group=self.steps)
        return box[0]

    def share_flag(self, flag: bool) -> bool:
        """Rank 0's flag on every rank (one byte over gloo, after each denoising step of the web demo)."""
        byte = torch.full((1,), int(flag), dtype=torch.uint8)
        dist.broadcast(byte, src=LEADER_RANK, group=self.steps)
        return bool(byte[0])
