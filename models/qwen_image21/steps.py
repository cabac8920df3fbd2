"""The transformer steps of a Qwen-Image 2.1 request and CFG branch, as `StepCall`s the shared pipeline runs.

With the prefix KV cache (the checkpoint's `causal_condition`, and `use_kv_cache` on), the first step of a
branch is the full pass with exact block-causal attention, run eagerly (`graphable=False`): it writes every
block's keys and values into the branch's cache. Every later step is the target-only pass, with no host
sync, which the pipeline captures once as a CUDA graph and replays. Without the cache every step is the
full pass (captured per request: its layout is baked into the graph).

The cache buffers live in `CacheSlot`s the model keeps across requests, one per (branch position in the
request, batch, sequence and target lengths, text padded or not), so the target step captured for one
request replays for every later request of the same shape: a graph reads fixed addresses, and the values
that differ between such requests (RoPE rows of the target, the key mask) are the step's tensors, which
the pipeline's graph copies into its static inputs. A branch re-runs its full pass whenever its slot holds
another branch's prefix (a new request, or another request in between).
"""

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from qwen_image_fusion.kernels.scale_modulate import ModulationRows
from qwen_image_fusion.models.family import Conditioning, StepCall
from qwen_image_fusion.models.qwen_image21.checkpoint import SLOT_TOKENS
from qwen_image_fusion.models.qwen_image21.layout import PrefixKVCache, TokenLayout, target_pass
from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer

MAX_SLOTS = 4  # cache buffers kept for reuse (CFG branches of two request shapes), unless planned


@dataclass(frozen=True)
class Conditioning21(Conditioning):
    """One CFG branch's conditioning, with where its condition images' vision tokens sit ([B, L] bool)."""

    image_slots: torch.Tensor

    def repeat(self, copies: int) -> "Conditioning21":
        repeated = super().repeat(copies)
        batch, seq = self.image_slots.shape
        slots = self.image_slots.repeat(1, copies).view(batch * copies, seq)
        return Conditioning21(repeated.embeds, repeated.mask, slots)

    @classmethod
    def stack(cls, parts: list[Conditioning]) -> "Conditioning21":
        stacked = super().stack(parts)
        return Conditioning21(stacked.embeds, stacked.mask, torch.cat([p.image_slots for p in parts]))


class CacheSlot:
    """Key/value buffers of every block for one request shape, reused by every request of that shape."""

    def __init__(self, buffers: torch.Tensor, rows: ModulationRows) -> None:
        self.buffers = buffers
        self.rows = rows  # the target's modulation rows: the same for every request of the shape
        self.current: PrefixKVCache | None = None  # the request's cache whose prefix the buffers hold

    def release(self) -> None:
        """Let go of the buffers (an evicted slot: no later step names it, though a graph may, until the
        pipeline drops that graph too)."""
        self.buffers, self.current = None, None

    def run(
        self,
        transformer: QwenImage21Transformer,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        rope: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The target-only step over the current request's prefix, its RoPE rows and key mask as given."""
        layout = self.current.layout
        plan = target_pass(layout.prefix_len, layout.seq_len, rope, self.rows, mask)
        return transformer.forward_cached(latents, sigma, layout, self.current, plan)


@dataclass(eq=False)
class FullPass:
    """The full pass of one request's branch (the static part of its StepCall); with a cache it fills it
    and marks its slot as holding this request's prefix."""

    layout: TokenLayout
    cache: PrefixKVCache | None = None
    slot: CacheSlot | None = None

    def run(
        self,
        transformer: QwenImage21Transformer,
        latents: torch.Tensor,
        embeds: torch.Tensor,
        sigma: torch.Tensor,
    ) -> torch.Tensor:
        out = transformer(latents, embeds, sigma, self.layout, self.cache)
        if self.slot is not None:
            self.slot.current = self.cache
        return out


@dataclass(eq=False)
class RequestSteps:
    """A request's geometry and, per CFG branch (in the order they first step), its full pass."""

    height: int  # target latent rows (pixels / 16)
    width: int
    condition: torch.Tensor | None  # the condition images' packed latents [1, tokens, z], or None
    condition_grids: tuple[tuple[int, int, int], ...] = ()
    branches: dict[int, tuple[Conditioning21, FullPass]] = field(default_factory=dict)

    @property
    def img_shapes(self) -> list[tuple[int, int, int]]:
        """diffusers' `img_shapes[0]`: each condition image's grid, then the target's."""
        return [*self.condition_grids, (1, self.height, self.width)]

    def joint_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The full pass's image rows: condition latents (repeated over the batch), then the target's."""
        if self.condition is None:
            return latents
        return torch.cat([self.condition.expand(latents.shape[0], -1, -1), latents], dim=1)


class StepPlanner:
    """Builds each step's StepCall for a transformer, keeping the cache slots across requests."""

    def __init__(self, transformer: QwenImage21Transformer, dtype: torch.dtype) -> None:
        self.transformer = transformer
        self.dtype = dtype
        self.use_kv_cache = True
        self.max_slots = MAX_SLOTS
        self.slots: OrderedDict[tuple, CacheSlot] = OrderedDict()

    def step_call(
        self, latents: torch.Tensor, sigma: torch.Tensor, branch: Conditioning21, request: RequestSteps
    ) -> StepCall:
        full = self._full_pass(branch, request)
        if full.slot is None:
            return StepCall((request.joint_latents(latents), branch.embeds, sigma), (full,))
        if full.slot.current is not full.cache:  # the buffers hold another prefix: fill them first
            return StepCall((request.joint_latents(latents), branch.embeds, sigma), (full,), graphable=False)
        target = full.layout.target
        return StepCall((latents, sigma, target.rope, target.calls[0].mask), (full.slot,))

    def keep(self, count: int) -> None:
        """Release the least recently used slots beyond `count`."""
        while len(self.slots) > count:
            self.slots.popitem(last=False)[1].release()

    def _full_pass(self, branch: Conditioning21, request: RequestSteps) -> FullPass:
        """The branch's full pass in this request, built (layout, cache slot) when it first steps."""
        known = request.branches.get(id(branch))
        if known is not None and known[0] is branch:
            return known[1]
        image_slots = branch.image_slots
        target = image_slots.new_ones(image_slots.shape[0], request.height * request.width // SLOT_TOKENS)
        img_mask = torch.cat([image_slots, target], dim=1)  # the target's slots close the sequence
        text_mask = None if branch.mask is None else branch.mask.bool()
        layout = self.transformer.layout(img_mask, request.img_shapes, text_mask)
        full = FullPass(layout)
        if self.use_kv_cache and self.transformer.config.causal_condition:
            full.slot, full.cache = self._slot(len(request.branches), layout)
        request.branches[id(branch)] = (branch, full)
        return full

    def _slot(self, position: int, layout: TokenLayout) -> tuple[CacheSlot, PrefixKVCache]:
        """The slot of this branch position and request shape (made on first use), and a cache of `layout`
        over its buffers."""
        mask = layout.target.calls[0].mask
        key = (position, layout.batch, layout.seq_len, layout.target_len, mask is None)
        slot = self.slots.get(key)
        if slot is None:
            self.keep(self.max_slots - 1)  # the device never holds more caches than that
            cache = self.transformer.new_kv_cache(layout, self.dtype)
            slot = CacheSlot(cache.buffers, layout.target.rows)
            self.slots[key] = slot
        else:
            cache = PrefixKVCache(layout, slot.buffers)
        self.slots.move_to_end(key)
        return slot, cache
