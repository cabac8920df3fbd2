"""Ulysses sequence parallelism: the joint [text, image] rows split over a group of ranks, attention over
head shards.

A model declares a `SequencePlan`: the module whose keyword inputs split (image rows, text rows, their RoPE
rows and the image rows' per-token modulation index; the key mask stays whole) and the module whose output
gathers the image rows back. `shard_sequence(model, group)` installs hooks from that plan, so the block code
stays as it is: projections, fused FP8 producers, q/k norm+RoPE and MLPs run on the local rows unchanged. The
all-to-all that trades sequence shards for head shards around attention sits in
`qwen_image_fusion.models.qwen_image.math.joint_attention`, which asks `active_shards()` whether the running
forward is sharded.

The split: the text rows and the image rows are each cut into contiguous, nearly equal parts (the first
`n % size` parts one row longer), and rank r keeps [text part r, image part r]. Splitting the text too,
rather than repeating it on every rank, keeps the text projections and MLPs from running `size` times and
makes the exchange one all-to-all of the joint rows. Nothing is padded: the all-to-all sends unequal
parts. After it, one copy puts the keys and values back in the one-process order [text, image], so
attention sums over its keys in the same order as one process and the key mask of padded prompts is used
whole, as is (no padded prompt: no mask, which keeps the flash kernels on GPUs); the queries stay in the
all-to-all's rank order, which attention does not care about. On the CPU this makes Ulysses images
byte-identical to one process; on GPUs the GEMMs see fewer rows, so cuBLAS may pick other kernels.
"""

import itertools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qwen_image_fusion.models.errors import InputError, ParallelError

Collective = Callable[[], None]


@dataclass(frozen=True)
class SequencePlan:
    """What a model declares for sequence parallelism: the keyword inputs of module `split` that are cut
    into per-rank rows, and the module `gather` whose output image rows [B, rows, C] are gathered."""

    split: str
    image_rows: str  # [B, S_img, C] along dim 1
    text_rows: str  # [B, S_txt, C] along dim 1
    rope: str  # (img [S_img, ...], txt [S_txt, ...]) named tuple, along dim 0
    gather: str
    image_index: str | None = None  # [B, S_img] per image row (or None at call time), along dim 1


def row_parts(rows: int, size: int) -> tuple[int, ...]:
    """Contiguous, nearly equal parts of `rows` over `size` ranks, the first `rows % size` one longer."""
    return tuple(rows // size + (r < rows % size) for r in range(size))


def offsets(parts: tuple[int, ...]) -> tuple[int, ...]:
    return (0, *itertools.accumulate(parts))


@dataclass
class Shards:
    """One sharded forward: the group, this rank's place in it, and every rank's text and image rows."""

    group: dist.ProcessGroup
    rank: int
    text: tuple[int, ...]
    image: tuple[int, ...]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # exchange buffers reused by every block

    @property
    def size(self) -> int:
        return len(self.text)

    @property
    def rows(self) -> list[int]:
        """Joint rows of every rank, in rank order: the all-to-all's split sizes."""
        return [t + i for t, i in zip(self.text, self.image, strict=True)]

    def text_slice(self) -> slice:
        start = offsets(self.text)[self.rank]
        return slice(start, start + self.text[self.rank])

    def image_slice(self) -> slice:
        start = offsets(self.image)[self.rank]
        return slice(start, start + self.image[self.rank])

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """The forward's exchange buffer `name`: one allocation shared by every block (blocks run in stream
        order), at a fixed address for CUDA-graph replays."""
        buf = self.buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype:
            buf = self.buffers[name] = like.new_empty(shape)
        return buf

    def to_head_shards(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, S_rank, H, D] rows of all heads -> [B, H/size, S, D] all rows of this rank's heads, in one
        all-to-all; keys and values back in the one-process row order, queries in rank order."""
        batch, rows, heads, dim = query.shape
        size, local_heads, total = self.size, heads // self.size, sum(self.rows)
        send = self.buffer("qkv_send", (size, rows, 3, batch, local_heads, dim), query)
        for i, t in enumerate((query, key, value)):
            send[:, :, i].copy_(t.unflatten(2, (size, local_heads)).permute(2, 1, 0, 3, 4))
        recv = self.buffer("qkv_recv", (total, 3, batch, local_heads, dim), query)
        self.all_to_all(recv, send.flatten(0, 1), self.rows, [rows] * size)
        keys = self.buffer("kv", (total, 2, batch, local_heads, dim), query)
        torch.cat([recv[r, 1:] for r in self.key_ranges()], out=keys)
        return tuple(t.permute(1, 2, 0, 3) for t in (recv[:, 0], keys[:, 0], keys[:, 1]))

    def key_ranges(self) -> list[slice]:
        """Row ranges of the all-to-all output ([text 0, image 0, text 1, ...]) in the one-process key
        order [text 0, text 1, ..., image 0, image 1, ...]."""
        starts = offsets(self.rows)
        text = [slice(starts[r], starts[r] + self.text[r]) for r in range(self.size)]
        image = [slice(starts[r] + self.text[r], starts[r + 1]) for r in range(self.size)]
        return text + image

    def to_sequence_shards(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H/size, S, D] attention output of this rank's heads -> [B, S_rank, H, D] this rank's rows."""
        batch, local_heads, _, dim = out.shape
        rows = self.rows[self.rank]
        send = self.buffer("out_send", (sum(self.rows), batch, local_heads, dim), out)
        send.copy_(out.permute(2, 0, 1, 3))
        recv = self.buffer("out_recv", (self.size, rows, batch, local_heads, dim), out)
        self.all_to_all(recv.flatten(0, 1), send, [rows] * self.size, self.rows)
        return recv.permute(2, 1, 0, 3, 4).flatten(2, 3)

    def gather_image_rows(self, local: torch.Tensor) -> torch.Tensor:
        """[B, image rows of this rank, C] -> [B, S_img, C] on every rank."""
        batch, rows, channels = local.shape
        longest = max(self.image)
        if rows < longest:  # all_gather needs equal parts: pad, then drop the padding below
            local = torch.cat([local, local.new_zeros(batch, longest - rows, channels)], dim=1)
        local, gathered = local.contiguous(), local.new_empty(self.size * batch, longest, channels)
        run_collective(lambda: all_gather(gathered, local, self.group), "image-row gather", self.size)
        parts = gathered.view(self.size, batch, longest, channels)
        return torch.cat([parts[r, :, : self.image[r]] for r in range(self.size)], dim=1)

    def all_to_all(
        self, recv: torch.Tensor, send: torch.Tensor, recv_rows: list[int], send_rows: list[int]
    ) -> None:
        run_collective(
            lambda: dist.all_to_all_single(recv, send, recv_rows, send_rows, group=self.group),
            "attention all-to-all",
            self.size,
        )


def all_gather(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
    """`output` [size * n, ...] = every rank's `local` [n, ...] in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(output, local, group=group)


_ACTIVE: ContextVar[Shards | None] = ContextVar("sequence_shards", default=None)
_CUT: ContextVar[Callable[[Collective], None] | None] = ContextVar("collective_cut", default=None)


def active_shards() -> Shards | None:
    """The shards of the sequence-parallel forward running now (inside the split module), or None."""
    return _ACTIVE.get()


@contextmanager
def cut_at_collectives(cut: Callable[[Collective], None]) -> Iterator[None]:
    """While active, collectives are not run but handed to `cut` (a CUDA-graph capture that ends a segment
    there and runs the collective between the segments' replays)."""
    token = _CUT.set(cut)
    try:
        yield
    finally:
        _CUT.reset(token)


def run_collective(op: Collective, what: str, size: int) -> None:
    """Run collective `op`, or hand it to the capture in progress; a failed or timed-out collective
    raises ParallelError on this rank instead of a backend traceback."""

    def checked() -> None:
        try:
            op()
        except RuntimeError as err:
            raise ParallelError(
                f"rank {dist.get_rank()}: the {what} across {size} ranks failed ({first_words(err)}); "
                "another rank died or stopped answering"
            ) from err

    cut = _CUT.get()
    if cut is None:
        checked()
    else:
        cut(checked)


def first_words(err: Exception) -> str:
    """A backend error's gist: its first sentence without the source location ("[pair.cc:537] ...")."""
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0]


class SequenceParallel:
    """Hooks that run a model's forward over `group` as its `sequence_parallel_plan` says."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup) -> None:
        plan: SequencePlan = model.sequence_parallel_plan
        self.plan, self.group = plan, group
        self.current: Shards | None = None
        self._tokens: list = []
        split, gather = model.get_submodule(plan.split), model.get_submodule(plan.gather)
        self._handles = [
            split.register_forward_pre_hook(self._split, with_kwargs=True),
            split.register_forward_hook(self._leave, always_call=True),
            gather.register_forward_hook(self._gather),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _split(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        plan = self.plan
        if args:
            raise TypeError(f"{plan.split} must be called with keyword arguments under sequence parallelism")
        size = dist.get_world_size(self.group)
        image, text = kwargs[plan.image_rows], kwargs[plan.text_rows]
        shards = Shards(
            self.group,
            dist.get_rank(self.group),
            row_parts(text.shape[1], size),
            row_parts(image.shape[1], size),
        )
        if min(shards.text) == 0 or min(shards.image) == 0:
            raise InputError(
                f"{text.shape[1]} text and {image.shape[1]} image tokens cannot be split over {size} ranks: "
                "sequence parallelism needs at least one of each per rank"
            )
        rows_txt, rows_img = shards.text_slice(), shards.image_slice()
        rope = kwargs[plan.rope]
        kwargs |= {
            plan.image_rows: image[:, rows_img],
            plan.text_rows: text[:, rows_txt],
            plan.rope: rope._replace(img=rope.img[rows_img], txt=rope.txt[rows_txt]),
        }
        if plan.image_index is not None and kwargs.get(plan.image_index) is not None:
            kwargs[plan.image_index] = kwargs[plan.image_index][:, rows_img].contiguous()
        self.current = shards
        self._tokens.append(_ACTIVE.set(shards))
        return args, kwargs

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._tokens:
            _ACTIVE.reset(self._tokens.pop())

    def _gather(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.current.gather_image_rows(output)


def shard_sequence(model: nn.Module, group: dist.ProcessGroup) -> SequenceParallel:
    """Run `model` sequence-parallel over `group` from now on; `.remove()` on the result undoes it."""
    heads = model.config.num_attention_heads
    size = dist.get_world_size(group)
    if heads % size:
        raise InputError(f"a Ulysses degree of {size} does not divide the model's {heads} attention heads")
    return SequenceParallel(model, group)
