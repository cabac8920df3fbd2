"""Issue 36's remaining levers, each measured before any is built (one H200, full-size random modules).

    python bench/lever_probe.py --out DIR [--only text,decode,attention,mlp]

- text: the Qwen2.5-VL-7B text encoder at batch 1 (one prompt, no padding), eager vs one CUDA-graph replay
  of the same call, and whether the replay's last hidden states equal eager's bytes.
- decode: the 1024x1024 VAE decode (`AutoencoderKLQwenImage`, BF16) as diffusers runs it, as a CUDA-graph
  replay, and as the opt-in fast decode (models/vae_decode.py: each causal conv of the single frame as the
  2D conv of its last temporal tap): time, and how far its pixels move.
- attention: BF16 SDPA against a forward-only FP8 (e4m3) flash-attention Triton kernel at a batch-1 step's
  shape (24 heads x 128, 4224 tokens): time and error against an fp32 reference, SDPA's own error beside.
- mlp: `img_mlp.net.2` (4224 x 12288 -> 3072) in BF16 vs FP8 `_scaled_mm`.

Writes DIR/lever_probe.json and prints one line per figure.
"""

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEVICE = torch.device("cuda")


def timed_ms(fn: Callable[[], object], runs: int = 20, warmup: int = 3) -> float:
    """Median CUDA-event milliseconds of `fn()` (host launches included: each call is timed alone)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """`fn` captured as a CUDA graph (after a warm-up on a side stream): its replay and static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


@torch.no_grad()
def probe_text() -> dict:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from qwen_image_fusion.models.qwen_image.prompt_template import PROMPT_TEMPLATE
    from qwen_image_fusion.models.qwen_image.text_encoder import qwen25_vl_7b_config
    from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer

    torch.manual_seed(0)
    with torch.device(DEVICE):
        encoder = Qwen2_5_VLForConditionalGeneration(qwen25_vl_7b_config()).to(torch.bfloat16).eval()
    tokenizer = build_qwen2_tokenizer()
    report = {}
    for prompt in (
        "a red fox in the snow, detailed fur",
        "a " + "very " * 60 + "long prompt about a lighthouse",
    ):
        tokens = tokenizer([PROMPT_TEMPLATE.format(prompt)], padding=True, return_tensors="pt").to(DEVICE)

        def eager(mask=tokens.attention_mask, ids=tokens.input_ids):
            out = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
            return out.hidden_states[-1]

        reference = eager().clone()
        maskless = eager(None).clone()
        torch.cuda.set_sync_debug_mode("warn")
        eager()
        torch.cuda.set_sync_debug_mode(0)
        entry = {"tokens": tokens.input_ids.shape[1], "mask_none_equal": torch.equal(reference, maskless)}
        entry["eager_ms"] = timed_ms(eager)
        try:
            replay, out = graphed(lambda: eager(None))
            replay()
            entry["graph_equal"] = torch.equal(out, reference)
            entry["graph_ms"] = timed_ms(replay)
            entry |= first_difference(encoder, tokens.input_ids)
        except Exception as error:  # a capture that fails is the finding
            entry["graph_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        report[f"tokens_{entry['tokens']}"] = entry
        print("text", entry, flush=True)
    return report


def first_difference(encoder: torch.nn.Module, ids: torch.Tensor) -> dict:
    """Where a graph replay of the encoder first departs from eager: the first hidden state (0: embeddings)
    that differs, and whether eager on a side stream (where the capture runs) equals eager on the default."""

    def states() -> tuple[torch.Tensor, ...]:
        return encoder(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states

    eager = [h.clone() for h in states()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = [h.clone() for h in states()]
    torch.cuda.synchronize()
    replay, out = graphed(states)
    replay()
    pairs = list(zip(eager, out, strict=True))
    first = next((i for i, (a, b) in enumerate(pairs) if not torch.equal(a, b)), None)
    return {
        "side_stream_equal": all(torch.equal(a, b) for a, b in zip(eager, on_side, strict=True)),
        "first_differing_state": first,
        "max_abs_diff_there": None
        if first is None
        else pairs[first][0].sub(pairs[first][1]).abs().max().item(),
    }


@torch.no_grad()
def probe_decode() -> dict:
    from diffusers import AutoencoderKLQwenImage

    from qwen_image_fusion.models.vae_decode import decode_frames

    torch.manual_seed(0)
    with torch.device(DEVICE):
        vae = AutoencoderKLQwenImage().to(torch.bfloat16).eval()
    z = torch.randn(1, 16, 1, 128, 128, device=DEVICE, dtype=torch.bfloat16)

    def decode():
        return vae.decode(z, return_dict=False)[0]

    reference = decode().clone()
    report = {"eager_ms": timed_ms(decode, runs=10)}
    try:
        replay, out = graphed(decode)
        replay()
        report["graph_equal"] = torch.equal(out, reference)
        report["graph_ms"] = timed_ms(replay, runs=10)
    except Exception as error:
        report["graph_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    two_d = decode_frames(vae, z, fast=True)[0].clone()
    report["conv2d_ms"] = timed_ms(lambda: decode_frames(vae, z, fast=True)[0], runs=10)
    levels = lambda x: ((x.float().clamp(-1, 1) + 1) * 127.5).round()  # noqa: E731
    reference = reference[:, :, 0]
    diff = (levels(two_d) - levels(reference)).abs()
    mse = ((two_d.float() - reference.float()) ** 2).mean().item() / 4  # on [0, 1] pixels
    report |= {
        "conv2d_equal": torch.equal(two_d, reference),
        "conv2d_max_level_diff": diff.max().item(),
        "conv2d_levels_changed": (diff > 0).float().mean().item(),
        "conv2d_psnr_db": 10 * math.log10(1 / mse) if mse > 0 else float("inf"),
    }
    print("decode", report, flush=True)
    return report


@triton.jit
def _fp8_attention(Q, K, Vt, Out, scale_log2e, out_scale, tokens,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   P_SCALE: tl.constexpr):  # fmt: skip
    """One (head, query block): Q, K [H, S, D] and Vt [H, D, S] in e4m3; P scaled by P_SCALE into e4m3."""
    start_m = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + head * tokens * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < tokens, other=0.0)  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, tokens, BLOCK_N):
        cols = start_n + offs_n
        k_t = tl.load(K + head * tokens * HEAD_DIM + cols[None, :] * HEAD_DIM + offs_d[:, None],
                      mask=cols[None, :] < tokens, other=0.0)  # fmt: skip
        qk = tl.dot(q, k_t) * scale_log2e
        qk = tl.where(cols[None, :] < tokens, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(Vt + head * HEAD_DIM * tokens + offs_d[None, :] * tokens + cols[:, None],
                    mask=cols[:, None] < tokens, other=0.0)  # fmt: skip
        acc = tl.dot((p * P_SCALE).to(tl.float8e4nv), v, acc)
        m_i = m_new
    out = acc * (out_scale / P_SCALE) / l_i[:, None]
    rows = Out + head * tokens * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(rows, out.to(tl.bfloat16), mask=offs_m[:, None] < tokens)


def fp8_attention(q, k, v, block_m: int = 128, block_n: int = 128, warps: int = 8, stages: int = 3):
    """Attention of q, k, v [1, H, S, D] (BF16) through per-tensor e4m3 Q, K, V; returns (out, kernel)."""
    _, heads, tokens, dim = q.shape
    scales = [t.abs().amax().float() / 448 for t in (q, k, v)]
    q8, k8 = ((t / s).to(torch.float8_e4m3fn).contiguous() for t, s in zip((q, k), scales[:2], strict=True))
    v8t = (v / scales[2]).to(torch.float8_e4m3fn).transpose(-1, -2).contiguous()
    out = torch.empty_like(q)
    scale_log2e = (scales[0] * scales[1] / math.sqrt(dim) * math.log2(math.e)).item()
    grid = (triton.cdiv(tokens, block_m), heads)

    def kernel():
        _fp8_attention[grid](q8, k8, v8t, out, scale_log2e, scales[2].item(), tokens, BLOCK_M=block_m,
                             BLOCK_N=block_n, HEAD_DIM=dim, P_SCALE=256.0, num_warps=warps,
                             num_stages=stages)  # fmt: skip
        return out

    return kernel(), kernel


@torch.no_grad()
def probe_attention() -> dict:
    torch.manual_seed(0)
    heads, tokens, dim = 24, 4224, 128
    q, k, v = (torch.randn(1, heads, tokens, dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    q, k = q * 2.0, k * 2.0  # sharper softmax than unit-variance noise: closer to trained attention
    truth = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    rel = lambda x: ((x.float() - truth).norm() / truth.norm()).item()  # noqa: E731
    flops = 4 * heads * tokens * tokens * dim
    report = {"sdpa_ms": timed_ms(sdpa), "sdpa_rel_error": rel(sdpa())}
    report["sdpa_tflops"] = flops / report["sdpa_ms"] / 1e9
    best = None
    for block_m, block_n, warps, stages in (
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 4, 2),
        (64, 128, 4, 3),
    ):
        out, kernel = fp8_attention(q, k, v, block_m, block_n, warps, stages)
        ms = timed_ms(kernel)
        if best is None or ms < best[0]:
            best = (ms, (block_m, block_n, warps, stages), rel(out))
    report |= {"fp8_kernel_ms": best[0], "fp8_config": best[1], "fp8_rel_error": best[2]}
    report["fp8_tflops"] = flops / best[0] / 1e9
    report["fp8_with_quant_ms"] = timed_ms(lambda: fp8_attention(q, k, v, *best[1])[0])
    print("attention", report, flush=True)
    return report


@torch.no_grad()
def probe_mlp() -> dict:
    rows, width, hidden = 4224, 3072, 12288
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(width, hidden, device=DEVICE, dtype=torch.bfloat16) * 0.02
    one = torch.ones((), device=DEVICE)
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    report = {
        "bf16_ms": timed_ms(lambda: F.linear(x, w)),
        "fp8_ms": timed_ms(
            lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        ),
    }
    print("mlp", report, flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="text,decode,attention,mlp")
    args = parser.parse_args()
    probes = {"text": probe_text, "decode": probe_decode, "attention": probe_attention, "mlp": probe_mlp}
    report = {}
    for name in args.only.split(","):
        try:
            report[name] = probes[name]()
            torch.cuda.empty_cache()
        except Exception as error:
            report[name] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
            print(name, report[name], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lever_probe.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
