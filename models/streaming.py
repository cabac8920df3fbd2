"""Weights that wait in host memory and come to the device when they run, byte for byte the same weights.

A component placed by `PlacedWeights` keeps its resident tensors on the device as usual. The tensors of two
or more dimensions of its streamed blocks (weight matrices, LoRA factors) live in pinned host memory; a
block's forward pre-hook points its modules at a copy in one of `slots` device buffers (block j always
uses slot j mod slots, so the addresses are fixed and a CUDA graph can capture the whole call), and its
post-hook points them back at the host copy and starts loading the block that reuses the slot. The copies
run on a side stream, ordered by events: a copy into a slot waits for the block that used it, a block waits
for its copy. A call is one pass over the block list, from the first block's start to the last block's end,
whatever method of the component makes it (`forward`, or a cached step that skips it). An `offload`ed
component also keeps its other moving tensors on the host, and brings them to the device only inside
`phase()` (prefetched with `prefetch()`, e.g. right after the previous request).

Outside a forward every moving tensor is its host copy, so code that reads or changes weights (LoRA
merging, the fusion gate, `state_dict()`) sees real data. Tensors below two dimensions (norms, biases,
scales) never move: the fusion gate reads the device from them. After the weights change, `place()` again
collects the tensors (new LoRA factors become host copies too).

`Link` is where the copies happen: `CudaLink` (pinned host memory, a CUDA side stream, CUDA events) or
`HostLink` (the CPU stands in for the device and copies at once), which runs the same placement and hooks
on a machine without a GPU (the CI tests prove the schedule and the bytes with it).
"""

import mmap
import weakref
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ALIGN = 512  # bytes between tensor starts in a buffer: any dtype's alignment, whole memory transactions


class Link(ABC):
    """Copies between host memory and `device` on a copy side that runs beside the compute side."""

    device: torch.device

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer whose storage is exactly its own anonymous pages (page-aligned, committed as
        they are written), so pinning it registers the storage torch's `is_pinned` looks at: CUDA graph
        capture refuses a host copy whose storage start is not pinned."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)

    @abstractmethod
    def pin(self, buffer: torch.Tensor) -> None:
        """Let the copy side read `buffer` asynchronously (after it is filled: pinning commits every page)."""

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    @abstractmethod
    def event(self) -> Any: ...

    @abstractmethod
    def fork(self) -> None:
        """Copies issued from now on wait for the compute work issued so far."""

    @abstractmethod
    def join(self) -> None:
        """Compute issued from now on waits for every copy issued so far."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst <- src` on the copy side."""

    @abstractmethod
    def after_compute(self, event: Any) -> None:
        """Record `event` after the compute work issued so far."""

    @abstractmethod
    def copies_wait(self, event: Any) -> None:
        """Copies issued from now on wait for `event`."""

    @abstractmethod
    def after_copies(self, event: Any) -> None:
        """Record `event` after the copies issued so far."""

    @abstractmethod
    def compute_waits(self, event: Any) -> None:
        """Compute issued from now on waits for `event`."""


class CudaLink(Link):
    """Pinned host memory, a CUDA side stream for the copies, CUDA events between the two streams."""

    def __init__(self, device: torch.device) -> None:
        # with its index: a bare `cuda` is not equal to the `cuda:0` of the tensors placed there
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        self.stream = torch.cuda.Stream(self.device)

    def pin(self, buffer: torch.Tensor) -> None:
        """Page-locked in place (cudaHostRegister, exact size: torch's pinned allocator rounds each block
        up to a power of two); unregistered when this buffer object goes (its placement let go of it)."""
        from torch.cuda._pin_memory_utils import pin_memory, unpin_memory

        if buffer.numel():
            pin_memory(buffer.data_ptr(), buffer.numel())
            weakref.finalize(buffer, unpin_memory, buffer.data_ptr())

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def fork(self) -> None:
        self.stream.wait_stream(self._compute())

    def join(self) -> None:
        self._compute().wait_stream(self.stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def after_compute(self, event: torch.cuda.Event) -> None:
        event.record(self._compute())

    def copies_wait(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def after_copies(self, event: torch.cuda.Event) -> None:
        event.record(self.stream)

    def compute_waits(self, event: torch.cuda.Event) -> None:
        self._compute().wait_event(event)


class HostLink(Link):
    """The CPU as the device: buffers in ordinary memory, every copy done when it is issued."""

    device = torch.device("cpu")

    def pin(self, buffer: torch.Tensor) -> None:
        pass

    def event(self) -> None:
        return None

    def fork(self) -> None:
        pass

    def join(self) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def after_compute(self, event: None) -> None:
        pass

    def copies_wait(self, event: None) -> None:
        pass

    def after_copies(self, event: None) -> None:
        pass

    def compute_waits(self, event: None) -> None:
        pass


def link_for(device: torch.device) -> Link:
    return CudaLink(device) if device.type == "cuda" else HostLink()


@dataclass(frozen=True)
class _Ref:
    """One place a module keeps a tensor: a parameter, a buffer, or an entry of its `stream_state()`."""

    module: nn.Module
    kind: str
    key: Any

    def set(self, tensor: torch.Tensor) -> None:
        if self.kind == "param":
            self.module._parameters[self.key] = tensor
        elif self.kind == "buffer":
            self.module._buffers[self.key] = tensor
        else:
            self.module.load_stream_state({self.key: tensor})

    def wrap(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as this place holds it (a parameter stays a parameter)."""
        return nn.Parameter(tensor, requires_grad=False) if self.kind == "param" else tensor


@dataclass
class _Moving:
    """A tensor that may leave the device, every place holding it, and its host copy once made."""

    tensor: torch.Tensor
    refs: list[_Ref] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def show(self, tensor: torch.Tensor) -> None:
        for ref in self.refs:
            ref.set(ref.wrap(tensor))


def _tensor_places(module: nn.Module) -> Iterator[tuple[str, Any, torch.Tensor | None]]:
    yield from (("param", k, t) for k, t in module._parameters.items())
    yield from (("buffer", k, t) for k, t in module._buffers.items())
    state = getattr(module, "stream_state", None)
    if state is not None:
        yield from (("state", k, t) for k, t in state().items())


def moving_tensors(root: nn.Module, skip: Sequence[nn.Module] = ()) -> list[_Moving]:
    """The tensors of two or more dimensions `root` holds, outside the modules in `skip`: parameters,
    buffers and what modules keeping tensors elsewhere declare in `stream_state()` (LoRA factors), each
    with every place holding it (a tied weight is one tensor, whatever objects hold it)."""
    skipped = {id(m) for s in skip for m in s.modules()}
    found: dict[tuple, _Moving] = {}
    for module in root.modules():
        if id(module) in skipped:
            continue
        for kind, key, tensor in _tensor_places(module):
            if tensor is not None and tensor.dim() >= 2:
                found.setdefault(_identity(tensor), _Moving(tensor)).refs.append(_Ref(module, kind, key))
    return list(found.values())


def _identity(tensor: torch.Tensor) -> tuple:
    """The same memory seen as the same tensor (tied weights; parameters wrapping one host copy)."""
    return tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())


def still_tensors(root: nn.Module) -> Iterator[tuple[_Ref, torch.Tensor]]:
    """The tensors below two dimensions `root` holds: they never leave the device."""
    for module in root.modules():
        for kind, key, tensor in _tensor_places(module):
            if tensor is not None and tensor.dim() < 2:
                yield _Ref(module, kind, key), tensor


def still_bytes(root: nn.Module) -> int:
    """Bytes of `root`'s tensors below two dimensions, each counted once."""
    sizes = {_identity(t): t.numel() * t.element_size() for _, t in still_tensors(root)}
    return sum(sizes.values())


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class _Group:
    """Tensors that come to the device together (a block, or an offloaded component's other tensors), laid
    out at aligned offsets of one device buffer; `host` holds their host copies."""

    def __init__(self, moving: list[_Moving]) -> None:
        self.moving = moving
        self.offsets, offset = [], 0
        for m in moving:
            self.offsets.append(offset)
            offset += _aligned(m.nbytes)
        self.nbytes = offset
        self.host: list[torch.Tensor] = [m.tensor for m in moving]
        self._shown: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]] = []  # what each place holds

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's place in `buffer` (uint8), with its dtype and shape."""
        return [
            buffer[offset : offset + m.nbytes].view(m.tensor.dtype).view(m.tensor.shape)
            for m, offset in zip(self.moving, self.offsets, strict=True)
        ]

    def load(self, link: Link, views: list[torch.Tensor]) -> None:
        for view, host in zip(views, self.host, strict=True):
            link.copy(view, host)

    def show(self, tensors: list[torch.Tensor]) -> None:
        """Point every place at `tensors` (the host copies, or views of a device buffer); the wrapped
        objects are made once per list, so a call swaps references only."""
        shown = next((objects for listed, objects in self._shown if listed is tensors), None)
        if shown is None:
            shown = [[ref.wrap(t) for ref in m.refs] for m, t in zip(self.moving, tensors, strict=True)]
            self._shown.append((tensors, shown))
        for m, objects in zip(self.moving, shown, strict=True):
            for ref, obj in zip(m.refs, objects, strict=True):
                ref.set(obj)

    def forget(self, tensors: list[torch.Tensor] | None) -> None:
        """Drop what `show` made for a list that is going away (a released device buffer's views)."""
        self._shown = [(listed, objects) for listed, objects in self._shown if listed is not tensors]


class PlacedWeights:
    """One component's weights placed on `link`'s device as a memory plan says: blocks of `blocks` streamed
    through slots at every call (hooks), and with `offload` its other moving tensors on the device only
    inside `phase()`. `place()` may be called again with another placement, or after the weights changed."""

    def __init__(self, root: nn.Module, blocks: nn.ModuleList | None, link: Link) -> None:
        self.root, self.blocks, self.link = root, blocks, link
        self.streamed: tuple[int, ...] = ()
        self.slots = 0
        self.offload = False
        self._hooks: list[Any] = []
        self._arenas: list[torch.Tensor] = []  # the host buffers holding the host copies
        self._groups: list[_Group] = []
        self._phase: _Group | None = None
        self._slot_views: list[list[torch.Tensor]] = []
        self._phase_views: list[torch.Tensor] | None = None
        self._phase_buffer: torch.Tensor | None = None
        self._loaded: list[Any] = []
        self._freed: list[Any] = []
        self._phase_loaded = link.event()
        self._lent: list[_Group] = []  # blocks whose buffer is lent to an offloaded component
        self._lent_views: list[list[torch.Tensor]] = []
        self._lent_buffer: torch.Tensor | None = None
        self._lent_loaded = False
        self._lent_event = link.event()
        self._borrower: PlacedWeights | None = None
        self._calls = False  # whether a call has a schedule (hooks): blocks streamed or lent

    @torch.no_grad()
    def place(
        self,
        streamed: Sequence[int] = (),
        slots: int = 0,
        offload: bool = False,
        lent: Sequence[int] = (),
        lend_bytes: int = 0,
    ) -> None:
        """Put every tensor where the placement wants it: small and resident ones on the device, streamed
        and `lent` blocks' and (with `offload`) the others' moving tensors in host memory. The lent blocks
        live in one fixed device buffer of at least `lend_bytes` that `lend()` gives to an offloaded
        component while it runs; they are copied back (`load_lent`) before this one runs again. The old
        placement's device buffers are let go and the tensors leaving the device have left before anything
        new comes to it, so the two never hold device memory at once; a tensor already on the device stays
        (no second copy)."""
        if streamed and (self.blocks is None or slots < 1):
            raise ValueError("streaming blocks needs a block list and at least one slot")
        self._remove_hooks()
        self._drop_phase()
        self.link.join()  # no copy into the old buffers may still be running
        self._slot_views, self._lent_views, self._lent_buffer = [], [], None
        self.streamed, self.slots, self.offload = tuple(streamed), slots if streamed else 0, offload
        streamed_blocks = [self.blocks[i] for i in self.streamed]
        lent_blocks = [self.blocks[i] for i in lent]
        self._groups = [_Group(moving_tensors(block)) for block in streamed_blocks]
        self._lent = [_Group(moving_tensors(block)) for block in lent_blocks]
        outside = moving_tensors(self.root, skip=streamed_blocks + lent_blocks)
        self._phase = _Group(outside) if offload else None
        for ref, tensor in still_tensors(self.root):
            if tensor.device != self.link.device:
                ref.set(ref.wrap(tensor.to(self.link.device)))
        incoming = [] if offload else [m for m in outside if not self._on_device(m.tensor)]
        self._to_host([*self._groups, *self._lent, *([self._phase] if offload else [])])
        for m in incoming:  # after the tensors leaving have left: the device never holds both
            m.tensor = m.tensor.to(self.link.device, copy=True)
            m.show(m.tensor)
        slot_bytes = max((g.nbytes for g in self._groups), default=0)
        self._slot_bytes = slot_bytes
        if self._groups and not offload:  # fixed buffers: a captured graph keeps their addresses
            buffers = [self.link.device_buffer(slot_bytes) for _ in range(self.slots)]
            self._slot_views = [g.views(buffers[j % self.slots]) for j, g in enumerate(self._groups)]
        self._lend_buffer_for(lend_bytes)
        self._loaded = [self.link.event() for _ in range(self.slots)]
        self._freed = [self.link.event() for _ in range(self.slots)]
        self._calls = calls = bool(self._groups or self._lent)
        if calls:  # a call is one pass over the blocks, whichever method of the root makes it
            self._hooks.append(self.blocks[0].register_forward_pre_hook(lambda *_: self._begin_call()))
        for j, block in enumerate(streamed_blocks):
            self._hook(block, lambda j=j: self._block_starts(j), lambda j=j: self._block_ends(j))
        for group, views, block in zip(self._lent, self._lent_views, lent_blocks, strict=True):
            self._hook(block, lambda g=group, v=views: g.show(v), lambda g=group: g.show(g.host))
        if calls:
            end = self.blocks[-1].register_forward_hook(lambda *_: self._end_call(), always_call=True)
            self._hooks.append(end)

    def _hook(self, module: nn.Module, before: Callable[[], None], after: Callable[[], None]) -> None:
        """`before()` as `module`'s forward starts, `after()` when it ends, also by an exception."""
        self._hooks.append(module.register_forward_pre_hook(lambda *_: before()))
        self._hooks.append(module.register_forward_hook(lambda *_: after(), always_call=True))

    def _lend_buffer_for(self, lend_bytes: int) -> None:
        """The lent blocks' fixed buffer (at least `lend_bytes`), each block's place in it; not loaded yet."""
        self._lent_buffer, self._lent_views, self._lent_loaded, self._borrower = None, [], False, None
        if not self._lent:
            return
        total = sum(g.nbytes for g in self._lent)
        self._lent_buffer = self.link.device_buffer(max(total, lend_bytes))
        offset = 0
        for group in self._lent:
            self._lent_views.append(group.views(self._lent_buffer[offset : offset + group.nbytes]))
            offset += group.nbytes

    def lend(self, borrower: "PlacedWeights") -> torch.Tensor | None:
        """The lent blocks' buffer, for `borrower` to run in (None without lent blocks); they are copied back
        by `load_lent`, before this component runs again."""
        if self._lent_buffer is None:
            return None
        self._lent_loaded, self._borrower = False, borrower
        return self._lent_buffer

    def load_lent(self) -> None:
        """Take the lent buffer back from its borrower and copy the lent blocks into it; compute issued from
        now on waits for them (outside any captured graph, which then finds them in place)."""
        if self._lent_buffer is None or self._lent_loaded:
            return
        if self._borrower is not None:
            self._borrower.release()
            self._borrower = None
        self.link.fork()
        for group, views in zip(self._lent, self._lent_views, strict=True):
            group.load(self.link, views)
        self.link.after_copies(self._lent_event)
        self.link.compute_waits(self._lent_event)
        self._lent_loaded = True

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.link.device and not self.is_host_copy(tensor)

    def is_host_copy(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives in one of this placement's host buffers."""
        return any(self._holds(arena, tensor) for arena in self._arenas)

    def _to_host(self, groups: list[_Group]) -> None:
        """Host copies for the groups' tensors that have none yet, one new host buffer per group (a block's
        tensors come and go together, so a buffer is let go whole when its block returns to the device, not
        kept for a part of it); host buffers no tensor lives in any more are let go."""
        kept = [a for a in self._arenas if any(self._holds(a, m.tensor) for g in groups for m in g.moving)]
        fresh_arenas = []
        for g in groups:
            fresh = [i for i, m in enumerate(g.moving) if not self.is_host_copy(m.tensor)]
            if not fresh:
                continue
            arena = self.link.host_buffer(sum(_aligned(g.moving[i].nbytes) for i in fresh))
            offset = 0
            for i in fresh:  # each source is let go once copied
                m = g.moving[i]
                host = arena[offset : offset + m.nbytes].view(m.tensor.dtype).view(m.tensor.shape)
                offset += _aligned(m.nbytes)
                host.copy_(m.tensor)
                m.show(host)
                m.tensor = g.host[i] = host
            self.link.pin(arena)
            fresh_arenas.append(arena)
        self._arenas = kept + fresh_arenas

    @staticmethod
    def _holds(arena: torch.Tensor, tensor: torch.Tensor) -> bool:
        return arena.device == tensor.device and 0 <= tensor.data_ptr() - arena.data_ptr() < arena.numel()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # The schedule of one call: the first `slots` streamed blocks load as the first block starts; block j
    # waits for its copy, and when it ends the copy of block j + slots into its slot starts, after j's
    # compute; compute joins the copies as the last block ends.
    def _begin_call(self) -> None:
        if self.offload and self._phase_views is None:
            raise RuntimeError("an offloaded component ran outside its phase")
        self.load_lent()  # already there unless a direct call follows a lend
        self.link.fork()
        for j in range(min(self.slots, len(self._groups))):
            self._issue(j)

    def _issue(self, j: int) -> None:
        slot = j % self.slots
        if j >= self.slots:
            self.link.copies_wait(self._freed[slot])
        self._groups[j].load(self.link, self._slot_views[j])
        self.link.after_copies(self._loaded[slot])

    def _block_starts(self, j: int) -> None:
        self.link.compute_waits(self._loaded[j % self.slots])
        self._groups[j].show(self._slot_views[j])

    def _block_ends(self, j: int) -> None:
        self._groups[j].show(self._groups[j].host)
        self.link.after_compute(self._freed[j % self.slots])
        if j + self.slots < len(self._groups):
            self._issue(j + self.slots)

    def _end_call(self) -> None:
        self.link.join()

    # A step cache (models/step_cache.py) may leave a call's middle blocks out: `skip_blocks` keeps the
    # schedule whole without them, and `cut` / `resume` let a CUDA-graph capture end and begin again at the
    # cache's decision (a graph must join every copy it forked, and may only wait for events it recorded).
    def skip_blocks(self, start: int, stop: int) -> None:
        """Blocks `start`..`stop`-1 do not run in this call: the copies of the streamed ones among them not
        issued yet are never issued (copies already running finish unread), the streamed blocks after them
        get theirs, and the call ends here if the last block was among them."""
        if not self._calls:
            return
        if self._groups:
            ran = bisect_left(self.streamed, start)  # streamed blocks before the skipped ones: they ran
            after = bisect_left(self.streamed, stop)  # the first streamed block after them
            for freed in self._freed:  # no block runs in its slot any more: copies into it may start
                self.link.after_compute(freed)
            for j in range(max(after, ran + self.slots), min(after + self.slots, len(self._groups))):
                self._issue(j)  # what the skipped blocks' ends would have issued
        if stop == len(self.blocks):
            self._end_call()

    def cut(self) -> None:
        """A captured graph ends mid-call: compute waits for the copies issued so far."""
        if self._calls:
            self.link.join()

    def resume(self) -> None:
        """The next graph of the call begins: copies wait for the compute before it, and the slots' events
        are recorded again in it (the copies they marked are done: `cut` joined them)."""
        if not self._calls:
            return
        self.link.fork()
        for loaded, freed in zip(self._loaded, self._freed, strict=True):
            self.link.after_copies(loaded)
            self.link.after_compute(freed)

    @property
    def phase_bytes(self) -> int:
        """The device buffer an offloaded component needs while it runs (its tensors and slots)."""
        return 0 if self._phase is None else self._phase.nbytes + self.slots * self._slot_bytes

    def prefetch(self, borrowed: torch.Tensor | None = None) -> None:
        """Start loading an offloaded component's tensors (a no-op when loaded or not offloaded), into
        `borrowed` (another component's lent buffer) when it is large enough."""
        if not self.offload or self._phase_buffer is not None:
            return
        phase = self._phase
        enough = borrowed is not None and borrowed.numel() >= self.phase_bytes
        buffer = borrowed if enough else self.link.device_buffer(self.phase_bytes)
        slots = [buffer[phase.nbytes + s * self._slot_bytes :][: self._slot_bytes] for s in range(self.slots)]
        self._slot_views = [g.views(slots[j % self.slots]) for j, g in enumerate(self._groups)]
        self._phase_buffer, self._phase_views = buffer, phase.views(buffer[: phase.nbytes])
        self.link.fork()
        phase.load(self.link, self._phase_views)
        self.link.after_copies(self._phase_loaded)

    @contextmanager
    def phase(self, borrowed: torch.Tensor | None = None) -> Iterator[None]:
        """Inside, an offloaded component's tensors are on the device (its streamed blocks still stream),
        in `borrowed` when given and large enough; after, they are host copies again and the buffer free."""
        if not self.offload:
            yield
            return
        self.prefetch(borrowed)
        self.link.compute_waits(self._phase_loaded)
        self._phase.show(self._phase_views)
        try:
            yield
        finally:
            self._phase.show(self._phase.host)
            self._drop_phase()

    def release(self) -> None:
        """Let go of the device buffer (a lender takes its buffer back): loaded again when next needed."""
        self._drop_phase()

    def _drop_phase(self) -> None:
        if self._phase_buffer is not None:
            self.link.join()  # no copy into the buffer may still be running when it is reused
            self._phase.forget(self._phase_views)
            for g, views in zip(self._groups, self._slot_views, strict=True):
                g.forget(views)
            self._slot_views = []
        self._phase_buffer, self._phase_views = None, None

    def device_bytes(self) -> int:
        """Bytes of this component's tensors on the device right now (outside a forward: its host copies
        excluded, also where the CPU stands in for the device)."""
        seen: dict[int, int] = {}
        for module in self.root.modules():
            for _, _, tensor in _tensor_places(module):
                if tensor is not None and self._on_device(tensor):
                    seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return sum(seen.values())
