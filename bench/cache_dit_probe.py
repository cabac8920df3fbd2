"""Probe: can the PyPI library cache-dit (DBCache / First-Block-Cache) be our step cache? CPU only.

Measures, on the embedded default model (6 blocks, 256x256, 20 steps, true CFG 4 by default):
1. whether `cache_dit.enable_cache(BlockAdapter(...))` applies to `QwenImageTransformer` and its
   `transformer_blocks` as they are (it installs, then the first step fails: our transformer calls the
   block stack as a module, cache-dit swaps in a plain ModuleList), and the runtime shim that works;
2. with the shim, how many block forwards run (counted by hooks) and which CFG branch of which step
   skips, at residual_diff_threshold 0.08 / 0.12, default warmup, enable_separate_cfg on / off, plus
   whether consecutive requests repeat (the transformer-only "persistent" context's step counter);
4. the per-call overhead of the cache decision on CPU (a threshold that never hits: Fn split,
   residual, mean, `.item()`), next to a plain call and a skipping call; also with near-free blocks,
   which isolates cache-dit's fixed host cost. Whole-request wall times are noisy on a shared CPU.

Run: `python bench/cache_dit_probe.py` (skips with a message when cache_dit is not installed).
"""

import importlib
import os
import statistics
import time
import traceback

import torch
from torch import nn

from qwen_image_fusion.models.qwen_image.transformer import TransformerBlocks
from qwen_image_fusion.pipelines.load_options import LoadOptions
from qwen_image_fusion.pipelines.loading import load
from qwen_image_fusion.pipelines.pipeline import Pipeline

PROMPT = "a red circle at the top left"
STEPS = 20
SEED = 0
cache_dit = None  # imported in main, after quieting its INFO logging


class BlockCounter:
    """Counts block forwards, and per transformer call how many blocks ran."""

    def __init__(self, transformer: nn.Module) -> None:
        self.total = 0
        self.per_call: list[int] = []
        self._current = 0
        self._handles = [b.register_forward_pre_hook(self._block) for b in transformer.transformer_blocks]
        self._handles.append(transformer.register_forward_pre_hook(self._begin))
        self._handles.append(transformer.register_forward_hook(self._end))

    def _block(self, *_: object) -> None:
        self.total += 1
        self._current += 1

    def _begin(self, *_: object) -> None:
        self._current = 0

    def _end(self, *_: object) -> None:
        self.per_call.append(self._current)

    def reset(self) -> None:
        self.total, self.per_call = 0, []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class BlocksHost(nn.Module):
    """What cache-dit needs: a module whose forward loops `self.transformer_blocks` block by block.

    Our `TransformerBlocks` is called as a module by `QwenImageTransformer.forward`; cache-dit patches
    the *attribute* `transformer_blocks` of the adapter's transformer with `ModuleList([CachedBlocks])`
    for the duration of its forward, so the host must iterate that attribute (Pattern_1: blocks take
    (hidden_states, encoder_hidden_states, *rest) and return (encoder_hidden_states, hidden_states)).
    """

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.transformer_blocks = blocks

    def forward(self, hidden_states, encoder_hidden_states, key_mask, temb, rope, mod_index=None):
        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states, encoder_hidden_states, key_mask, temb, rope, mod_index
            )
        return hidden_states


def attach(transformer: nn.Module, config: object) -> tuple[BlocksHost, object]:
    """Enable cache-dit through the host; route `transformer.transformer_blocks(...)` to it (runtime only)."""
    blocks = transformer.transformer_blocks
    host = BlocksHost(blocks)
    adapter = cache_dit.BlockAdapter(
        transformer=host,
        blocks=blocks,
        blocks_name="transformer_blocks",
        forward_pattern=cache_dit.ForwardPattern.Pattern_1,
    )
    cache_dit.enable_cache(adapter, cache_config=config)
    blocks.forward = host.__call__  # instance attribute: the class is untouched
    return host, adapter


def detach(transformer: nn.Module, adapter: object) -> None:
    cache_dit.disable_cache(adapter)
    vars(transformer.transformer_blocks).pop("forward", None)


def context_of(host: BlocksHost):
    manager = host._context_manager
    return manager.get_context(host._context_names[0])


def generate(pipe: Pipeline) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    latents = pipe.generate(PROMPT, seed=SEED, num_inference_steps=STEPS, output_type="latent")
    return latents, time.perf_counter() - start


def skipped_calls(per_call: list[int], blocks: int) -> str:
    """'step:branch' of every transformer call that ran fewer blocks (branch p = positive, n = negative)."""
    return " ".join(f"{i // 2}{'pn'[i % 2]}" for i, n in enumerate(per_call) if n < blocks) or "-"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def probe_as_is(pipe: Pipeline) -> None:
    print("\n[1] BlockAdapter on QwenImageTransformer.transformer_blocks as they are")
    tr = pipe.transformer
    adapter = cache_dit.BlockAdapter(
        transformer=tr, blocks=tr.transformer_blocks, forward_pattern=cache_dit.ForwardPattern.Pattern_1
    )
    cache_dit.enable_cache(
        adapter, cache_config=cache_dit.DBCacheConfig(Fn_compute_blocks=1, num_inference_steps=STEPS)
    )
    print("  enable_cache(BlockAdapter(transformer=tr, blocks=tr.transformer_blocks, Pattern_1)): ok")
    try:
        generate(pipe)
        print("  generate: ran (unexpected)")
    except Exception as e:
        frame = traceback.extract_tb(e.__traceback__)[-3]
        print(f"  generate: {type(e).__name__}: {e}  (at {frame.filename.split('/')[-1]}:{frame.lineno})")
    cache_dit.disable_cache(adapter)
    generate(pipe)
    print("  disable_cache(adapter): plain generate runs again")

    print("  shim with the default DBCacheConfig (Fn_compute_blocks=8) on 6 blocks:")
    host, adapter = attach(tr, cache_dit.DBCacheConfig(num_inference_steps=STEPS))
    try:
        generate(pipe)
    except AssertionError as e:
        print(f"    AssertionError: {e}")
    finally:
        detach(tr, adapter)
    del host


def run_request(pipe: Pipeline, counter: BlockCounter, reference: torch.Tensor, label: str) -> bool:
    """One cached request; prints blocks run, seconds, error vs plain and the skipped calls."""
    blocks = len(pipe.transformer.transformer_blocks)
    counter.reset()
    try:
        latents, seconds = generate(pipe)
    except Exception as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
        print(f"  {label}: {type(e).__name__}: {e} (at {where}, call {len(counter.per_call)})")
        return False
    print(
        f"  {label}: blocks {counter.total}/{STEPS * 2 * blocks}, {seconds:.2f}s, rel.err vs plain "
        f"{rel_err(latents, reference):.4f}, skipped [{skipped_calls(counter.per_call, blocks)}]"
    )
    return True


def probe_skips(pipe: Pipeline, reference: torch.Tensor, plain_s: float) -> None:
    print(f"\n[2] block skips, {STEPS} steps, true CFG (positive then negative), Fn=1 Bn=0, warmup 8")
    print("  skipped calls as step+branch: p = positive, n = negative (our order: p then n each step)")
    tr = pipe.transformer
    counter = BlockCounter(tr)
    print(f"  plain: {STEPS * 2 * len(tr.transformer_blocks)} block forwards, {plain_s:.2f}s per request")
    for separate in (True, False):
        for threshold in (0.08, 0.12):
            config = cache_dit.DBCacheConfig(
                Fn_compute_blocks=1,
                Bn_compute_blocks=0,
                residual_diff_threshold=threshold,
                enable_separate_cfg=separate,
                num_inference_steps=STEPS,
            )
            host, adapter = attach(tr, config)
            label = f"sep_cfg={separate!s:5} thr={threshold}"
            try:
                # Consecutive requests: does the persistent context's step counter restart per request?
                for request in range(3):
                    if not run_request(pipe, counter, reference, f"{label} req{request}"):
                        break
                    if request == 0:
                        ctx = context_of(host)
                        print(
                            f"    ctx: executed_steps={ctx.executed_steps}"
                            f" transformer_steps={ctx.transformer_executed_steps}"
                            f" cached={ctx.cached_steps} cfg_cached={ctx.cfg_cached_steps}"
                        )
                        diffs = [round(v, 3) for v in ctx.residual_diffs.values()]
                        print(f"    residual diffs (non-CFG-labelled calls): {diffs}")
                # An explicit refresh before a request (the transformer-only API) restarts the counters.
                cache_dit.refresh_context(host, cache_config=config)
                run_request(pipe, counter, reference, f"{label} after refresh_context")
            finally:
                detach(tr, adapter)
    counter.remove()


def time_calls(fn, reps: int = 15) -> float:
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


class TinyBlock(nn.Module):
    """A near-free block with our calling convention, to expose cache-dit's fixed per-call host cost."""

    def forward(self, hidden_states, encoder_hidden_states, key_mask, temb, rope, mod_index=None):
        return encoder_hidden_states + 1e-3, hidden_states + 1e-3


def compare(make_call, module: nn.Module, blocks: nn.ModuleList, rounds: int = 3) -> list[str]:
    """Median ms per call, interleaved rounds: plain, cache-dit never hitting, cache-dit always hitting."""
    counted = [0]
    handles = [b.register_forward_pre_hook(lambda *_: counted.__setitem__(0, counted[0] + 1)) for b in blocks]
    # Fn=1, no warmup; 1e-9 never hits on varying inputs (every call pays Fn + residual + mean + .item());
    # 0.99 always hits after the first call (Fn block + cached residual add).
    configs = {"never": 1e-9, "always": 0.99}
    results: dict[str, list[float]] = {"plain": [], "never": [], "always": []}
    counts: dict[str, int] = {}
    for _ in range(rounds):
        counted[0] = 0
        results["plain"].append(time_calls(make_call))
        counts["plain"] = counted[0]
        for name, threshold in configs.items():
            config = cache_dit.DBCacheConfig(
                Fn_compute_blocks=1, residual_diff_threshold=threshold, max_warmup_steps=0
            )
            _, adapter = attach(module, config)
            counted[0] = 0
            results[name].append(time_calls(make_call))
            counts[name] = counted[0]
            detach(module, adapter)
    for h in handles:
        h.remove()
    calls = 16  # one warm-up call + 15 timed, per round
    return [f"{k} {min(v):.3f} ms ({counts[k] / calls:.1f} blocks/call)" for k, v in results.items()]


def probe_overhead(pipe: Pipeline) -> None:
    print("\n[4] per-call cost on CPU: min over 3 interleaved rounds of the median ms, 1 thread")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tr = pipe.transformer
    captured: dict = {}

    def grab(_module, args, kwargs):
        captured.setdefault("call", (args, kwargs))

    handle = tr.register_forward_pre_hook(grab, with_kwargs=True)
    pipe.generate(PROMPT, seed=SEED, num_inference_steps=2, output_type="latent")
    handle.remove()
    args, kwargs = captured["call"]
    # Inputs must vary call to call: on identical inputs the residual diff is exactly 0 and every call hits.
    g = torch.Generator().manual_seed(1)
    pool = [args[0] + 0.05 * torch.randn(args[0].shape, generator=g).to(args[0].dtype) for _ in range(4)]
    turn = [0]

    def model_call():
        turn[0] += 1
        with torch.inference_mode():
            tr(pool[turn[0] % 4], *args[1:], **kwargs)

    print(
        "  real transformer (6 blocks, 256 image tokens):",
        " | ".join(compare(model_call, tr, tr.transformer_blocks)),
    )

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer_blocks = TransformerBlocks(TinyBlock() for _ in range(6))

        def forward(self, h, e):
            return self.transformer_blocks(h, e, None, None, None)

    toy = Toy()
    h, e = torch.randn(1, 256, 64), torch.randn(1, 8, 64)

    def toy_call():
        turn[0] += 1
        toy(h * (1 + turn[0] % 4), e)

    print("  near-free blocks (host cost only):", " | ".join(compare(toy_call, toy, toy.transformer_blocks)))
    torch.set_num_threads(threads)


def main() -> None:
    global cache_dit
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
    try:
        cache_dit = importlib.import_module("cache_dit")
    except ImportError:
        print("cache_dit is not installed: pip install --no-deps cache-dit; skipping the probe")
        return
    print(f"cache-dit {cache_dit.__version__}, torch {torch.__version__}")
    torch.manual_seed(0)
    pipe = load(LoadOptions(device="cpu"))
    print(
        f"pipeline: {pipe.model_name}, {pipe.variant}, {pipe.precision.describe()}, defaults {pipe.defaults}"
    )
    reference, plain_s = generate(pipe)
    probe_as_is(pipe)
    probe_skips(pipe, reference, plain_s)
    probe_overhead(pipe)


if __name__ == "__main__":
    main()
