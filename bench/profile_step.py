"""Kernel-time breakdown of one denoise step on a full-size DiT (random weights), by kernel and by kind,
against the GPU's roofline.

    python bench/profile_step.py --request t2i-cfg --graph --out DIR       # a request of REQUESTS
    python bench/profile_step.py --variant fp8-fused --config 1024x2 --out DIR
    python bench/profile_step.py --tables-from DIR/profile_*.json [--out DIR]

A request (REQUESTS: family, size, batch, CFG branches, input images, prompt tokens) runs its step as the
product does: the family model's own step hooks (`step_call`, `run_step`) over the bare DiT, one call per CFG
branch (the pipeline runs each branch as its own batch), each a CUDA-graph replay with `--graph` (2.1: the
KV-cached target-only step, after each branch's full pass has filled its cache). `--config SIZExBATCH` is a
Qwen-Image text-to-image call of that batch (the step_bench shape).

Profiles one step after warm-up with the CUDA profiler, then times `--runs` back-to-back steps while sampling
the SM clock and power with nvidia-smi. The work model of the step (`step_work`, `count_bytes`):
- GEMMs: each linear's `2 x rows x in x out` FLOPs and `A + B + C` bytes at their dtypes (FP8 input and
  weight for an FP8 linear, BF16 otherwise; BF16 output; biases left out), rows by the linear's name
  (ROW_RULES: image, text, conditioning rows);
- attention: `4 x queries x keys x width` FLOPs per block, bytes of Q, K, V and O in BF16;
- every other kernel (our producers, GELU, q/k norm + RoPE, static quant, copies, other): no FLOPs, bytes
  counted in one eager step: each tensor a Triton kernel is launched with, and each tensor an aten op (not
  a GEMM, attention or view) takes or returns, once per launch (a copy's destination as written only).
Each item's time at the limit is the larger of FLOPs / dense peak and bytes / HBM bandwidth (PEAKS, by the
device's name); a step's limit is their sum. Writes DIR/profile_<variant>[-graph]_<request or config>
.{json,md}; `--tables-from` rewrites the Markdown of stored reports and, given several, writes the merged
roofline table (DIR/roofline.md with `--out`): step / limit per request.
"""

import argparse
import json
import re
import statistics
import subprocess
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from step_bench import VARIANTS, build, step_inputs
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qwen_image_fusion.models.family import Conditioning, StepCall
from qwen_image_fusion.models.fp8 import Fp8Linear
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.math import ImageLayout
from qwen_image_fusion.models.qwen_image.model import QwenImageModel, latent_size
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image21.model import QwenImage21Model
from qwen_image_fusion.models.qwen_image21.steps import Conditioning21, StepPlanner
from qwen_image_fusion.models.qwen_image_edit.model import EditCanvas, QwenImageEditModel


@dataclass(frozen=True)
class Peak:
    """Dense tensor-core peaks (NVIDIA's datasheets halve their sparse figures) and HBM bandwidth."""

    fp8_tflops: float
    bf16_tflops: float
    hbm_tbps: float

    def tflops(self, kind: str) -> float | None:
        """The compute peak a kind's FLOPs run at (None: no FLOPs counted)."""
        peaks = {"fp8 gemm": self.fp8_tflops, "bf16 gemm": self.bf16_tflops, "attention": self.bf16_tflops}
        return peaks.get(kind)


# By the device's name, first match; a device not listed is read against the H200's.
PEAKS = {"H200": Peak(1979.0, 989.5, 4.8), "H100 80GB HBM3": Peak(1979.0, 989.5, 3.35)}
DEFAULT_PEAK = "H200"
ANALYTIC = ("fp8 gemm", "bf16 gemm", "attention")  # kinds whose work `step_work` counts from the shapes

KINDS = (  # first match wins: our kernels by name, then FP8 GEMMs (cuBLAS "nvjet_*_qq*", e4m3), then BF16
    ("producers (ours)", ("_layer_norm", "_gated_residual", "_tanh_residual")),
    ("gelu (ours)", ("_gelu",)),
    ("swiglu (ours)", ("_silu_mul",)),
    ("q/k norm+rope (ours)", ("_rms_norm_rope",)),
    ("fp8 quant (ours)", ("_static_quant",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("convolution", ("fprop", "implicit_gemm", "conv2d", "conv3d", "convolution", "winograd", "cudnn")),
    ("fp8 gemm", ("_qqtst", "e4m3", "f8f8", "_fp8_gemv")),
    ("bf16 gemm", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "splitkreduce")),
    ("copies/cat", ("copy", "cat", "concat", "memcpy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


@dataclass(frozen=True)
class Request:
    """One request's denoising step as the product runs it: the DiT family, output size, rows per call,
    calls per step (one per CFG branch), input images whose latent tokens join the sequence, prompt tokens."""

    family: str  # "qwen-image" (text to image; Edit-2511 with zero_cond_t) or "qi21"
    size: int
    branches: int
    what: str
    batch: int = 1
    references: int = 0  # input images of size x size
    zero_cond_t: bool = False
    text: int = 128


REQUESTS = {
    "t2i-cfg": Request("qwen-image", 1024, 2, "Qwen-Image 1024x1024, true CFG"),
    "lightning4": Request("qwen-image", 1024, 1, "Qwen-Image Lightning-4 1024x1024 (CFG off)"),
    # text: the prompt's 128 tokens and the input image's 196 vision tokens (Plus: a 384x384 area, 28 pixels a
    # token); the DiT's image rows: the target's 4096 latent tokens and the input image's 4096
    "edit2511-cfg": Request(
        "qwen-image",
        1024,
        2,
        "Edit-2511 1024x1024, one 1024x1024 input image, CFG",
        references=1,
        zero_cond_t=True,
        text=128 + 196,
    ),
    "qi21-cfg": Request("qi21", 1024, 2, "Qwen-Image 2.1 1024x1024, CFG (KV-cached target step)"),
}


def request_config(request: Request, layers: int | None) -> QwenImageConfig | QwenImage21Config:
    """The full-size DiT config of a request's family (`layers`: fewer blocks for quick trials)."""
    if request.family == "qi21":
        return QwenImage21Config(**({} if layers is None else {"num_layers": layers}))
    return QwenImageConfig(num_layers=60 if layers is None else layers, zero_cond_t=request.zero_cond_t)


# ---- the work model ----


@dataclass(frozen=True)
class CallShape:
    """The rows one DiT call computes, totals over its batch, by what the linears read: `temb` rows of the
    conditioning vector (time embedding, image modulation), per-sample `samples` rows (Qwen-Image's text
    modulation and output norm), `text` prompt rows, `image` latent rows into `img_in`, `blocks` rows of the
    blocks' (image-stream) linears, `out` rows into `proj_out`; `attention` the (queries, keys) of each SDPA
    call of a block, per sample."""

    batch: int
    temb: int
    samples: int
    text: int
    image: int
    blocks: int
    out: int
    attention: tuple[tuple[int, int], ...]


# Which rows each linear reads, by its name (first match; the empty pattern matches the rest).
TEXT_STREAM = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "txt_mlp", "txt_in")
ROW_RULES: dict[str, tuple[tuple[tuple[str, ...], str], ...]] = {
    "qwen-image": (
        (("time_text_embed", "img_mod"), "temb"),
        (("txt_mod", "norm_out.linear"), "samples"),
        (TEXT_STREAM, "text"),
        (("img_in",), "image"),
        (("proj_out",), "out"),
        ((), "blocks"),
    ),
    "qi21": (
        (("time_text_embed", "modulation", "norm_out.linear"), "temb"),
        (("txt_in",), "text"),
        (("img_in",), "image"),
        (("proj_out",), "out"),
        ((), "blocks"),
    ),
}


def call_shape(family: str, config, size: int, batch: int, text: int, references: int = 0) -> CallShape:
    """One call's rows. Qwen-Image: 8x VAE and 2x2 patches, the target's tokens then each input image's, text
    and image in one attention call, `temb` twice the batch with `zero_cond_t`. 2.1 (16x VAE): with
    `causal_condition` the product's step is the target-only pass over the cached prefix (no text rows; the
    target attends to every key; `temb` has the extra t = 0 row), else the full pass (text and image rows
    in the blocks; block-causal calls over the prefix, then the target over every key)."""
    if family == "qwen-image":
        tokens = (size // (8 * config.patch_size)) ** 2 * (1 + references)
        joint = text + tokens
        rows = batch * tokens
        temb = batch * (2 if config.zero_cond_t else 1)
        return CallShape(batch, temb, batch, batch * text, rows, rows, rows, ((joint, joint),))
    target = (size // (16 * config.patch_size)) ** 2
    prefix = [text] + [target] * references
    seq = sum(prefix) + target
    if config.causal_condition:
        rows = batch * target
        return CallShape(batch, batch + 1, batch, 0, rows, rows, rows, ((target, seq),))
    ends = [sum(prefix[: i + 1]) for i in range(len(prefix))]
    calls = (*zip(prefix, ends, strict=True), (target, seq))
    image = batch * (seq - text)
    return CallShape(batch, batch, batch, batch * text, image, batch * seq, batch * target, calls)


def linear_rows(model: nn.Module, family: str, shape: CallShape) -> dict[str, tuple[int, nn.Module]]:
    """Each linear's rows in one call (by ROW_RULES) and the module."""
    rows = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear | Fp8Linear):
            continue
        field = next(f for needles, f in ROW_RULES[family] if not needles or any(n in name for n in needles))
        rows[name] = (getattr(shape, field), module)
    return rows


BLOCK_PREFIX = re.compile(r"^transformer_blocks\.\d+\.")


def step_work(model: nn.Module, family: str, shapes: list[CallShape]) -> list[dict[str, Any]]:
    """FLOPs and bytes of the GEMMs and attention of one step (the calls `shapes`), as items grouped by kind,
    linear (block index dropped) and shape: `{kind, what, count, flops, bytes}`."""
    items: dict[tuple, dict[str, Any]] = {}

    def add(kind: str, what: str, flops: float, nbytes: float) -> None:
        empty = {"kind": kind, "what": what, "count": 0, "flops": 0, "bytes": 0}
        item = items.setdefault((kind, what), empty)
        item["count"] += 1
        item["flops"] += flops
        item["bytes"] += nbytes

    config = model.config
    width, blocks = config.num_attention_heads * config.attention_head_dim, len(model.transformer_blocks)
    for shape in shapes:
        for name, (rows, module) in linear_rows(model, family, shape).items():
            if not rows:
                continue
            fp8 = isinstance(module, Fp8Linear)
            out_features, in_features = module.weight.shape
            act = 1 if fp8 else 2  # the input's bytes: FP8 (written by a producer or the quantizer) or BF16
            nbytes = rows * in_features * act + in_features * out_features * act + rows * out_features * 2
            what = f"{BLOCK_PREFIX.sub('', name)} {rows}x{in_features}->{out_features}"
            add("fp8 gemm" if fp8 else "bf16 gemm", what, 2.0 * rows * in_features * out_features, nbytes)
        for queries, keys in shape.attention:
            b = shape.batch
            for _ in range(blocks):  # Q and O at the queries' rows, K and V at the keys'
                nbytes = 2 * b * width * (2 * queries + 2 * keys)
                add("attention", f"sdpa {b}x{queries}x{keys}", 4.0 * b * queries * keys * width, nbytes)
    return list(items.values())


def tensor_bytes(values: Any, skip: tuple = ()) -> int:
    """Bytes of the distinct tensors in `values` (nested), those in `skip` left out."""
    seen, total = {_key(t) for t in tree_flatten(skip)[0] if isinstance(t, torch.Tensor)}, 0
    for t in tree_flatten(values)[0]:
        if isinstance(t, torch.Tensor) and _key(t) not in seen:
            seen.add(_key(t))
            total += t.numel() * t.element_size()
    return total


def _key(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "set_", "resize_", "record_stream", "is_same_size", "_unsafe_view",
             "_reshape_alias", "_fused_sdp_choice"}  # fmt: skip
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "mv", "addmv", "dot"}
COPIES = {"copy_", "cat", "clone", "_to_copy", "stack", "_copy_from"}
WRITE_ONLY = {"copy_", "fill_", "zero_"}  # their destination is written, not read


class ByteCounter(TorchDispatchMode):
    """Bytes read and written by the kernels of the kinds `step_work` does not count, by kind, while active:
    aten ops through this dispatch mode, Triton kernels through their launch (`counting`)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.launches: dict[str, int] = defaultdict(int)

    def add(self, name: str, nbytes: int) -> None:
        kind = kind_of(name)
        if kind not in ANALYTIC:
            self.bytes[kind] += nbytes
            self.launches[kind] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if not (func.is_view or name in NO_KERNEL or name in GEMMS or "attention" in name):
            written_only = args[0] if name in WRITE_ONLY else ()
            nbytes = tensor_bytes((args, kwargs), skip=written_only) + tensor_bytes(out)
            self.add("copy" if name in COPIES else name, nbytes)
        return out

    @contextmanager
    def counting(self) -> Iterator["ByteCounter"]:
        """Count aten ops and Triton launches (compiled and interpreted kernels) while in the block."""
        launchers = _triton_launchers()
        runs = {cls: cls.run for cls in launchers}

        def counted(run):
            def launch(kernel, *args, **kwargs):
                if not kwargs.get("warmup"):
                    self.add(kernel.fn.__name__, tensor_bytes((args, kwargs)))
                return run(kernel, *args, **kwargs)

            return launch

        for cls in launchers:
            cls.run = counted(runs[cls])
        try:
            with self:
                yield self
        finally:
            for cls, run in runs.items():
                cls.run = run


def _triton_launchers() -> list[type]:
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    return [JITFunction, InterpretedFunction]


def count_bytes(run: Callable[[], Any]) -> list[dict[str, Any]]:
    """The measured bytes of `run()` (one eager step) as work items, one per kind."""
    with torch.no_grad(), ByteCounter().counting() as counter:
        run()
    return [
        {"kind": k, "what": f"measured, {counter.launches[k]} launches", "count": 1, "flops": 0, "bytes": b}
        for k, b in sorted(counter.bytes.items())
    ]


# ---- the product's step ----


def product_steps(model: nn.Module, family: str, references: int) -> tuple[SimpleNamespace, type]:
    """A holder of the bare DiT (and 2.1's step planner) and the family model class whose hooks (`canvas`,
    `step_call`, `run_step`: what the pipeline calls each step) run on it: the product's step without a text
    encoder or VAE."""
    holder = SimpleNamespace(transformer=model, planner=StepPlanner(model, torch.bfloat16))
    hooks = QwenImage21Model if family == "qi21" else QwenImageEditModel if references else QwenImageModel
    return holder, hooks


def request_calls(
    model: nn.Module, family: str, size: int, batch: int, text: int, branches: int, references: int
) -> tuple[Callable, list[StepCall]]:
    """`run_step` and each CFG branch's StepCall of one step on random inputs. A call that cannot be replayed
    (2.1's full pass, which fills the branch's KV cache) runs once here; the branch's next call is the one a
    step repeats."""
    config, device = model.config, model.transformer_blocks[0].attn.norm_q.weight.device
    gen = torch.Generator(device).manual_seed(0)
    holder, hooks = product_steps(model, family, references)
    step_call, run_step = partial(hooks.step_call, holder), partial(hooks.run_step, holder)
    if family == "qi21":
        canvas = QwenImage21Model.canvas(holder, size, size)  # no input images: the latent grid alone
        tokens = canvas.height * canvas.width
        latents = torch.randn(batch, tokens, config.in_channels, generator=gen, device=device)
        prompts = [
            Conditioning21(
                torch.randn(batch, text, config.context_in_dim, generator=gen, device=device).bfloat16(),
                None,
                torch.zeros(batch, text, dtype=torch.bool, device=device),
            )
            for _ in range(branches)
        ]
        latents, sigma = latents.bfloat16(), torch.full((batch,), 0.6, device=device)
    else:
        latents, _, sigma, _ = step_inputs(config, size, batch, text, device)
        target = latent_size(size, size, 8)
        canvas = target
        if references:
            tokens = latents.shape[1] * references
            images = torch.randn(1, tokens, config.in_channels, generator=gen, device=device).bfloat16()
            canvas = EditCanvas(target, images, ImageLayout(target.grid, (target.grid,) * references))
        prompts = [
            Conditioning(step_inputs(config, size, batch, text, device)[1], None) for _ in range(branches)
        ]
    calls = []
    with torch.no_grad():
        for branch in prompts:
            call = step_call(latents, sigma, branch, canvas)
            if not call.graphable:
                run_step(*call.tensors, *call.static)
                call = step_call(latents, sigma, branch, canvas)
            calls.append(call)
    return run_step, calls


def device_peak(name: str) -> tuple[str, Peak]:
    return next(((k, p) for k, p in PEAKS.items() if k in name), (DEFAULT_PEAK, PEAKS[DEFAULT_PEAK]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", choices=REQUESTS, help="a request's step (REQUESTS); else --config")
    parser.add_argument("--variant", choices=VARIANTS, default="fp8-fused")
    parser.add_argument("--config", default="1024x2", help="SIZExBATCH: a Qwen-Image text-to-image call")
    parser.add_argument("--text", type=int, help="prompt tokens (default: the request's, or 128)")
    parser.add_argument("--layers", type=int, help="DiT blocks (default: the family's, 60 or 32)")
    parser.add_argument("--cfg-as-batch", action="store_true", help="a request's CFG branches as one batch")
    parser.add_argument("--graph", action="store_true", help="profile a CUDA-graph replay")
    parser.add_argument("--runs", type=int, default=10, help="back-to-back steps timed after the profile")
    parser.add_argument("--out", type=Path, help="where the JSON and Markdown go")
    parser.add_argument("--tables-from", type=Path, nargs="+", help="rewrite the Markdown of stored reports")
    args = parser.parse_args()
    if args.tables_from:
        reports = [json.loads(path.read_text()) for path in args.tables_from]
        for report, path in zip(reports, args.tables_from, strict=True):
            summary = write_tables(report, path.with_suffix(".md"))
        if len(reports) == 1:
            print(summary)
            return
        order = list(REQUESTS)  # the declared requests first, in their order
        reports.sort(key=lambda r: order.index(r["request"]) if r.get("request") in order else len(order))
        merged = merged_table(reports)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "roofline.md").write_text(merged + "\n")
        print(merged)
        return
    if args.out is None:
        parser.error("--out is required to profile")
    if args.request:
        request, label = REQUESTS[args.request], args.request
    else:
        size, batch = (int(v) for v in args.config.split("x"))
        request, label = Request("qwen-image", size, 1, f"Qwen-Image {args.config}", batch), args.config
    text = request.text if args.text is None else args.text
    batch, branches = request.batch, request.branches
    if args.cfg_as_batch:
        batch, branches, label = batch * branches, 1, f"{label}-as-batch"
    device = torch.device("cuda")
    config = request_config(request, args.layers)
    model = build(args.variant, config, device)
    shape = call_shape(request.family, config, request.size, batch, text, request.references)
    if args.variant.startswith("diffusers"):  # eager, diffusers' signature; text to image only
        latents, prompt, sigma, grid = step_inputs(config, request.size, batch, text, device)

        def step():
            for _ in range(branches):
                model(latents, prompt, None, sigma, [[grid]] * batch, return_dict=False)

        eager = step
    else:
        run_step, calls = request_calls(
            model, request.family, request.size, batch, text, branches, request.references
        )

        def eager():
            for call in calls:
                run_step(*call.tensors, *call.static)

        step = eager
        if args.graph:
            from qwen_image_fusion.pipelines.cuda_graph import GraphedStep

            graphed = GraphedStep(run_step)

            def step():
                for call in calls:
                    graphed(*call.tensors, static=call.static)

    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.runs + 3)]
    with torch.no_grad():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        measured = count_bytes(eager)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            events[0].record()
            step()
            events[1].record()
            torch.cuda.synchronize()
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE,
            text=True,
        )
        events[2].record()
        for i in range(args.runs):
            step()
            events[3 + i].record()
        torch.cuda.synchronize()
        smi.terminate()
    samples = clock_power_samples(smi.communicate()[0])
    runs_ms = [events[2 + i].elapsed_time(events[3 + i]) for i in range(args.runs)]
    kernels = [
        {"kernel": e.key, "count": e.count, "ms": e.device_time_total / 1000}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    report = {
        "request": args.request,
        "label": label,
        "declaration": asdict(request),
        "variant": args.variant,
        "config": f"{request.size}x{batch}",
        "calls": branches,
        "text": text,
        "layers": len(model.transformer_blocks),
        "graph": args.graph,
        "device": torch.cuda.get_device_name(device),
        "fusion_summary": getattr(model, "fusion_report", None) and model.fusion_report.summary(),
        "step_ms_profiled": events[0].elapsed_time(events[1]),
        "back_to_back_ms": runs_ms,
        "sm_clock_mhz_power_w": samples,
        "kernels": sorted(kernels, key=lambda k: -k["ms"]),
        "call_shape": asdict(shape),
        "work": step_work(model, request.family, [shape] * branches) + measured,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"profile_{args.variant}{'-graph' if args.graph else ''}_{label}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(write_tables(report, stem.with_suffix(".md")))


def clock_power_samples(text: str) -> list[tuple[float, float]]:
    """(SM MHz, W) pairs from nvidia-smi's CSV lines; lines it could not read ("[N/A]") are skipped."""
    samples = []
    for line in text.splitlines():
        try:
            clock, power = (float(v) for v in line.split(","))
        except ValueError:
            continue
        samples.append((clock, power))
    return samples


# ---- tables ----


def work_items(report: dict) -> list[dict[str, Any]]:
    """A report's work items; reports from before the byte counts give FLOPs by kind only."""
    if "work" in report:
        return report["work"]
    return [
        {"kind": k, "what": "", "count": 1, "flops": f, "bytes": None}
        for k, f in report.get("work_flops", {}).items()
    ]


def roofline(report: dict) -> dict[str, Any]:
    """Per kind: kernel ms, launches, FLOPs, bytes and ms at the limit (each item's larger of FLOPs / peak and
    bytes / HBM, summed; None where a kind's bytes are unknown or it has no work counted); per step: the
    back-to-back median (else the profiled step), the kernel sum, the limit over the kinds that have one and
    the ratios to it."""
    peak_name, peak = device_peak(report.get("device", ""))
    kinds: dict[str, dict[str, Any]] = {}
    for k in report["kernels"]:
        entry = kinds.setdefault(kind_of(k["kernel"]), {"ms": 0.0, "launches": 0})
        entry["ms"] += k["ms"]
        entry["launches"] += k["count"]
    for item in work_items(report):
        entry = kinds.setdefault(item["kind"], {"ms": 0.0, "launches": 0})
        entry.setdefault("flops", 0.0)
        entry.setdefault("bytes", 0.0)
        entry.setdefault("limit_ms", 0.0)
        tflops = peak.tflops(item["kind"])
        compute_ms = item["flops"] / tflops / 1e9 if tflops else 0.0
        entry["flops"] += item["flops"]
        if item["bytes"] is None or entry["bytes"] is None:
            entry["bytes"] = entry["limit_ms"] = None
            continue
        entry["bytes"] += item["bytes"]
        entry["limit_ms"] += max(compute_ms, item["bytes"] / peak.hbm_tbps / 1e9)
    for entry in kinds.values():
        for key in ("flops", "bytes", "limit_ms"):
            entry.setdefault(key, None)
    runs = report.get("back_to_back_ms") or [report["step_ms_profiled"]]
    step_ms = statistics.median(runs)
    kernel_ms = sum(e["ms"] for e in kinds.values())
    limited = [e["limit_ms"] for e in kinds.values() if e["limit_ms"] is not None]
    limit_ms = sum(limited) if limited else None
    return {
        "peak_name": peak_name,
        "peak": peak,
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])),
        "unmodeled": sorted(k for k, e in kinds.items() if e["limit_ms"] is None),
        "step_ms": step_ms,
        "kernel_ms": kernel_ms,
        "limit_ms": limit_ms,
        "step_over_limit": step_ms / limit_ms if limit_ms else None,
        "kernels_over_limit": kernel_ms / limit_ms if limit_ms else None,
    }


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def kind_row(kind: str, e: dict[str, Any], peak: Peak) -> list[str]:
    """ms, launches, TFLOP, GB, TFLOP/s, GB/s, % of the compute peak, % of HBM, ms at the limit, ms / limit
    (blank where nothing is counted)."""
    ms, flops, nbytes, limit = e["ms"], e["flops"] or None, e["bytes"] or None, e["limit_ms"] or None
    tflops = flops / ms / 1e9 if flops and ms else None
    gbps = nbytes / ms / 1e6 if nbytes and ms else None
    compute = peak.tflops(kind)
    return [
        f"{ms:.2f}",
        str(e["launches"]),
        _fmt(flops and flops / 1e12, ".2f"),
        _fmt(nbytes and nbytes / 1e9, ".2f"),
        _fmt(tflops, ".0f"),
        _fmt(gbps, ".0f"),
        _fmt(100 * tflops / compute if tflops and compute else None, ".0f", "%"),
        _fmt(100 * gbps / (peak.hbm_tbps * 1000) if gbps else None, ".0f", "%"),
        _fmt(limit, ".2f"),
        _fmt(ms / limit if limit else None, ".2f"),
    ]


KIND_COLUMNS = (
    "| kind | ms | launches | TFLOP | GB | TFLOP/s | GB/s | of FLOP peak | of HBM | limit ms | ms / limit |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
)


def peak_line(r: dict[str, Any]) -> str:
    p = r["peak"]
    return (
        f"Peaks: {r['peak_name']}'s dense FP8 {p.fp8_tflops:g}, BF16 {p.bf16_tflops:g} TFLOP/s, HBM "
        f"{p.hbm_tbps:g} TB/s; each item at its limit = max(FLOPs / peak, bytes / HBM)."
    )


def label(report: dict) -> str:
    """The request (and `-as-batch`), or the SIZExBATCH config of a report without one."""
    return report.get("label") or report.get("request") or report["config"]


def title(report: dict) -> str:
    what = report.get("declaration", {}).get("what") or f"{report['config']}"
    calls = report.get("calls", 1)
    return (
        f"{label(report)}: {what}; {report['variant']}"
        f"{' (graph replay)' if report.get('graph') else ''}, {calls} call{'s' * (calls > 1)} of"
        f" {report['config']} a step, {report['text']} text tokens, {report['layers']} blocks"
    )


def write_tables(report: dict, path: Path) -> str:
    """Writes the Markdown tables (per kind, top kernels) of a profile report; returns the summary part."""
    r = roofline(report)
    runs_ms, samples = report.get("back_to_back_ms", []), report.get("sm_clock_mhz_power_w", [])
    lines = [
        f"# {title(report)}",
        "",
        f"Step {report['step_ms_profiled']:.1f} ms under the profiler, kernels {r['kernel_ms']:.1f} ms"
        + (f"; device {report['device']}" if report.get("device") else ""),
        "",
    ]
    if runs_ms:  # reports from before the back-to-back timing have none
        lines += [f"{len(runs_ms)} back-to-back steps (ms): {', '.join(f'{t:.1f}' for t in runs_ms)}", ""]
    if samples:
        lines += [
            f"SM clock (MHz) / power (W) while timing: min {min(c for c, _ in samples):.0f} /"
            f" max {max(p for _, p in samples):.0f} over {len(samples)} samples",
            "",
        ]
    lines += [
        *KIND_COLUMNS,
        *(f"| {kind} | " + " | ".join(kind_row(kind, e, r["peak"])) + " |" for kind, e in r["kinds"].items()),
        "",
        peak_line(r),
    ]
    if r["limit_ms"]:
        lines += [
            "",
            f"Step {r['step_ms']:.1f} ms (back-to-back median) / limit {r['limit_ms']:.1f} ms ="
            f" **{r['step_over_limit']:.2f}x**; kernels / limit {r['kernels_over_limit']:.2f}x"
            + (f" (no model for: {', '.join(r['unmodeled'])})" if r["unmodeled"] else ""),
        ]
    summary = "\n".join(lines)
    lines += [
        "",
        "| kernel | kind | launches | ms |",
        "|---|---|---:|---:|",
        *(
            f"| `{k['kernel'][:100]}` | {kind_of(k['kernel'])} | {k['count']} | {k['ms']:.2f} |"
            for k in report["kernels"][:30]
        ),
    ]
    if work_items(report) and "work" in report:
        lines += [
            "",
            "| work item | kind | count | TFLOP | GB |",
            "|---|---|---:|---:|---:|",
            *(
                f"| {w['what']} | {w['kind']} | {w['count']} | {w['flops'] / 1e12:.3f} |"
                f" {w['bytes'] / 1e9:.3f} |"
                for w in sorted(report["work"], key=lambda w: -max(w["flops"] / 1e12, w["bytes"] / 1e9))
            ),
        ]
    path.write_text("\n".join(lines) + "\n")
    return summary


def merged_table(reports: list[dict]) -> str:
    """One roofline table over several request reports: a headline row per request (step, kernels, limit,
    step / limit), then each request's kinds."""
    rooflines = [(report, roofline(report)) for report in reports]
    peaks = {r["peak_name"] for _, r in rooflines}
    lines = [
        "| request | calls x SIZExBATCH | step ms | kernels ms | limit ms | step / limit | kernels / limit |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for report, r in rooflines:
        lines.append(
            f"| {label(report)} | {report.get('calls', 1)} x {report['config']}"
            f" | {r['step_ms']:.1f} | {r['kernel_ms']:.1f} | {_fmt(r['limit_ms'], '.1f')}"
            f" | {_fmt(r['step_over_limit'], '.2f', 'x')} | {_fmt(r['kernels_over_limit'], '.2f', 'x')} |"
        )
    lines += ["", "| request " + KIND_COLUMNS[0], "|---" + KIND_COLUMNS[1]]
    for report, r in rooflines:
        lines += [
            f"| {label(report)} | {kind} | " + " | ".join(kind_row(kind, e, r["peak"])) + " |"
            for kind, e in r["kinds"].items()
        ]
    lines += ["", *(f"- {title(report)}" for report, _ in rooflines), "", peak_line(rooflines[0][1])]
    if len(peaks) > 1:
        lines.append(f"(The reports ran on different devices: {', '.join(sorted(peaks))}.)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
