"""bench/profile_step.py's roofline on CPU (no CUDA at import): the work model of every family's step against
counts made here by hand from the configs' dims, the rows its name rules give each linear against the rows the
product's step feeds it, the byte counter, the kernel-kind classifier on real kernel names, and the merged
table's step / limit from synthetic reports."""

import json
import sys
from dataclasses import replace

import pytest
import torch
from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))  # the scripts import their siblings (step_bench) by name
import profile_step as ps
from step_bench import build

from qwen_image_fusion.kernels.quant import inverse_scale, static_quant_fp8
from qwen_image_fusion.models.fp8 import Fp8Linear, QuantizedActivation
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config

CPU = torch.device("cpu")
SIZE = 64  # pixels: 4x4 = 16 latent tokens in both families (Qwen-Image 8x VAE + 2x2 patches, 2.1 16x VAE)
TOKENS = 16
T2I = QwenImageConfig(
    num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48,
    axes_dims_rope=(8, 12, 12),
)  # fmt: skip
EDIT = replace(T2I, zero_cond_t=True)
QI21 = QwenImage21Config(
    in_channels=16, out_channels=16, num_layers=2, attention_head_dim=32, num_attention_heads=2,
    context_in_dim=24, axes_dims_rope=(8, 12, 12),
)  # fmt: skip
QI21_FULL_PASS = QwenImage21Config(
    in_channels=8, out_channels=8, num_layers=1, attention_head_dim=16, num_attention_heads=4,
    context_in_dim=40, mlp_ratio=2, axes_dims_rope=(4, 6, 6), causal_condition=False,
)  # fmt: skip
# family, config, prompt tokens, input images
CASES = {
    "t2i": ("qwen-image", T2I, 5, 0),
    "edit": ("qwen-image", EDIT, 7, 1),
    "qi21": ("qi21", QI21, 6, 0),
    "qi21 full pass": ("qi21", QI21_FULL_PASS, 6, 0),
}


@pytest.fixture(scope="module")
def models():
    """Each case's DiT as the GPU path builds it (step_bench.build, FP8 with the family's default BF16
    fallback), tiny, on the CPU."""
    return {
        name: build("fp8-fused", config, CPU, calibration_size=SIZE)
        for name, (_, config, *_) in CASES.items()
    }


def gemm(rows: int, k: int, n: int, fp8: bool) -> tuple[int, int]:
    """FLOPs and bytes (input, weight, BF16 output) of a [rows, k] x [k, n] product."""
    width = 1 if fp8 else 2
    return 2 * rows * k * n, rows * k * width + k * n * width + rows * n * 2


def tally(products: list[tuple[int, int, int, bool]], repeat: int = 1) -> dict[str, list[int]]:
    totals = {"fp8 gemm": [0, 0], "bf16 gemm": [0, 0]}
    for rows, k, n, fp8 in products:
        flops, nbytes = gemm(rows, k, n, fp8)
        kind = totals["fp8 gemm" if fp8 else "bf16 gemm"]
        kind[0] += repeat * flops
        kind[1] += repeat * nbytes
    return totals


def by_kind(items: list[dict]) -> dict[str, list[float]]:
    totals: dict[str, list[float]] = {}
    for item in items:
        kind = totals.setdefault(item["kind"], [0, 0])
        kind[0] += item["flops"]
        kind[1] += item["bytes"]
    return totals


def qwen_image_by_hand(
    config: QwenImageConfig, text: int, references: int, batch: int
) -> dict[str, list[int]]:
    """DESIGN §1's linears at one call's rows: image rows (target and input images), text rows, the
    conditioning vector's rows (2B with zero_cond_t, for the time embedding and the image modulation; B for
    the text modulation and norm_out); the default fallback (DESIGN §3) keeps the modulation, the image MLP's
    down projection and everything outside the blocks BF16, the rest is FP8 (the text MLP's down projection
    too); attention over text + image rows."""
    d, j = config.num_attention_heads * config.attention_head_dim, config.joint_attention_dim
    image, txt = batch * TOKENS * (1 + references), batch * text
    temb = batch * (2 if config.zero_cond_t else 1)
    block = [
        *[(image, d, d, True)] * 4, (image, d, 4 * d, True), (image, 4 * d, d, False),
        *[(txt, d, d, True)] * 4, (txt, d, 4 * d, True), (txt, 4 * d, d, True),
        (temb, d, 6 * d, False), (batch, d, 6 * d, False),
    ]  # fmt: skip
    outside = [
        (image, config.in_channels, d, False), (txt, j, d, False), (temb, 256, d, False), (temb, d, d, False),
        (batch, d, 2 * d, False), (image, d, config.patch_size**2 * config.out_channels, False),
    ]  # fmt: skip
    work = tally(block, config.num_layers)
    for kind, (flops, nbytes) in tally(outside).items():
        work[kind][0] += flops
        work[kind][1] += nbytes
    joint = text + TOKENS * (1 + references)
    layers = config.num_layers
    work["attention"] = [4 * batch * joint * joint * d * layers, 2 * batch * d * 4 * joint * layers]
    return work


def qi21_cached_by_hand(config: QwenImage21Config, text: int, batch: int) -> dict[str, list[int]]:
    """The KV-cached target-only step: the target's rows through img_in, the blocks and proj_out; no text
    rows; B + 1 conditioning rows (the t = 0 row) for the time embedding, the shared modulation and norm_out;
    Q/K/V/out and the SwiGLU's gate and up projections in FP8, its down projection BF16; attention from the
    target's rows to every key (text and target)."""
    d, h = config.inner_dim, config.inner_dim * config.mlp_ratio
    rows, temb = batch * TOKENS, batch + 1
    block = [*[(rows, d, d, True)] * 4, (rows, d, h, True), (rows, d, h, True), (rows, h, d, False)]
    outside = [
        (rows, config.in_channels, d, False), (temb, 256, d, False), (temb, d, d, False),
        (temb, d, 4 * d, False), (temb, d, d, False), (rows, d, config.out_channels, False),
    ]  # fmt: skip
    work = tally(block, config.num_layers)
    for kind, (flops, nbytes) in tally(outside).items():
        work[kind][0] += flops
        work[kind][1] += nbytes
    keys, layers = text + TOKENS, config.num_layers
    work["attention"] = [
        4 * batch * TOKENS * keys * d * layers,
        2 * batch * d * (2 * TOKENS + 2 * keys) * layers,
    ]
    return work


@pytest.mark.parametrize("case", ["t2i", "edit", "qi21"])
@pytest.mark.parametrize("batch", [1, 2])
def test_work_model_equals_the_count_by_hand(models, case, batch):
    family, config, text, references = CASES[case]
    shape = ps.call_shape(family, config, SIZE, batch, text, references)
    expected = (
        qi21_cached_by_hand(config, text, batch)
        if family == "qi21"
        else qwen_image_by_hand(config, text, references, batch)
    )
    assert by_kind(ps.step_work(models[case], family, [shape])) == expected
    two_branches = {k: [2 * v for v in values] for k, values in expected.items()}
    assert by_kind(ps.step_work(models[case], family, [shape, shape])) == two_branches


@pytest.mark.parametrize("case", list(CASES))
def test_name_rules_give_each_linear_the_rows_the_product_step_feeds_it(models, case):
    """One CFG branch's call of the product's step (the family model's hooks; 2.1's first, cache-filling
    pass run before): every linear's input rows, seen by a hook, equal the rows ROW_RULES give it, and
    those it gives rows to are the linears that run (2.1's cached step runs no text linear)."""
    family, config, text, references = CASES[case]
    model = models[case]
    run_step, calls = ps.request_calls(model, family, SIZE, 2, text, 2, references)
    seen: dict[str, int] = {}

    def rows_of(name: str, module, args) -> None:
        x = args[0].data if isinstance(args[0], QuantizedActivation) else args[0]
        seen[name] = x.numel() // module.weight.shape[1]

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear | Fp8Linear)]
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: rows_of(n, mod, args)) for n, m in linears]
    try:
        with torch.no_grad():
            run_step(*calls[1].tensors, *calls[1].static)
    finally:
        for hook in hooks:
            hook.remove()
    shape = ps.call_shape(family, config, SIZE, 2, text, references)
    ruled = {name: rows for name, (rows, _) in ps.linear_rows(model, family, shape).items() if rows}
    assert ruled == seen
    assert len(calls) == 2 and all(call.graphable for call in calls)


def test_request_declarations_build_full_size_shapes():
    edit = ps.REQUESTS["edit2511-cfg"]
    config = ps.request_config(edit, None)
    assert config.zero_cond_t and config.num_layers == 60
    shape = ps.call_shape(edit.family, config, edit.size, edit.batch, edit.text, edit.references)
    assert (shape.image, shape.temb, shape.attention) == (8192, 2, ((8192 + 324, 8192 + 324),))
    qi21 = ps.REQUESTS["qi21-cfg"]
    config = ps.request_config(qi21, None)
    shape = ps.call_shape(qi21.family, config, qi21.size, qi21.batch, qi21.text)
    rows = (config.num_layers, shape.blocks, shape.text, shape.attention)
    assert rows == (32, 4096, 0, ((4096, 4096 + 128),))
    assert [r.branches for r in ps.REQUESTS.values()] == [2, 1, 2, 2]


def test_byte_counter_counts_reads_and_writes_of_aten_ops():
    a, b, w = torch.ones(4, 8), torch.ones(4, 8), torch.ones(8, 3)
    counter = ps.ByteCounter()
    with counter.counting():
        torch.cat([a, b])  # reads 2 x 128, writes 256
        a.view(8, 4).t()  # views: no kernel
        a @ w  # a GEMM: step_work counts it
        b.mul_(2)  # reads b, writes b
        torch.empty(3, 3).copy_(torch.ones(3, 3)[:, 0:3])  # the destination written only
    assert dict(counter.bytes) == {"copies/cat": 512 + 72, "other": 256 + 36}
    assert dict(counter.launches) == {"copies/cat": 2, "other": 2}  # `ones` is a fill: other


@pytest.mark.interpreter
def test_byte_counter_counts_the_tensors_a_triton_kernel_is_launched_with():
    y = torch.randn(2, 64).bfloat16()
    inv = inverse_scale(torch.tensor(0.5))
    counter = ps.ByteCounter()
    with counter.counting():
        assert static_quant_fp8.triton(y, inv) is not None
    assert counter.bytes["fp8 quant (ours)"] == 2 * 64 * 2 + 2 * 64 + 4  # y read, q written, the scale
    assert counter.launches["fp8 quant (ours)"] == 1


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_bias_TNT", "fp8 gemm"),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "bf16 gemm"),
        ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_bias_TNT", "bf16 gemm"),
        (
            "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16>",
            "bf16 gemm",
        ),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4>", "bf16 gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1", "attention"),
        ("_gelu_tanh_quant_kernel", "gelu (ours)"),
        ("_gated_residual_layer_norm_modulate_kernel", "producers (ours)"),
        ("_layer_norm_modulate_kernel", "producers (ours)"),
        ("_tanh_residual_layer_norm_scale_kernel", "producers (ours)"),
        ("_layer_norm_scale_kernel", "producers (ours)"),
        ("_silu_mul_quant_kernel", "swiglu (ours)"),
        ("_rms_norm_rope_kernel", "q/k norm+rope (ours)"),
        ("_static_quant_fp8_kernel", "fp8 quant (ours)"),
        ("_fp8_gemv_kernel", "fp8 gemm"),
        (
            "void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<at::native::(anon",
            "copies/cat",
        ),
        ("Memcpy DtoD (Device -> Device)", "copies/cat"),
        ("Memset (Unknown)", "other"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::silu_kernel(at::Tenso", "other"),
    ],
)
def test_kernel_kinds(name, kind):
    assert ps.kind_of(name) == kind


def report(request: str, device: str, runs: list[float], kernels: list, work: list) -> dict:
    return {
        "request": request, "declaration": {"what": request}, "variant": "fp8-fused", "config": "1024x1",
        "calls": 2, "text": 128, "layers": 60, "graph": True, "device": device, "step_ms_profiled": runs[0],
        "back_to_back_ms": runs, "kernels": kernels, "work": work,
    }  # fmt: skip


def item(kind: str, flops: float, nbytes: float) -> dict:
    return {"kind": kind, "what": kind, "count": 1, "flops": flops, "bytes": nbytes}


KERNELS = [
    {"kernel": "nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_bias_TNT", "count": 3, "ms": 4.0},
    {"kernel": "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "count": 2, "ms": 2.0},
    {"kernel": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "count": 1, "ms": 3.0},
    {"kernel": "_layer_norm_modulate_kernel", "count": 2, "ms": 1.0},
    {"kernel": "Memset (Unknown)", "count": 5, "ms": 0.1},
]
WORK = [
    item("fp8 gemm", 3.958e12, 0.48e9),  # compute-bound: 2 ms at 1979 TFLOP/s
    item("bf16 gemm", 989.5e9, 0.0),  # 1 ms of compute
    item("bf16 gemm", 1e9, 4.8e9),  # 1 ms of H200 bytes: each item at its own limit, then summed
    item("attention", 1.979e12, 1e9),  # 2 ms at 989.5
    item("producers (ours)", 0, 2.4e9),  # 0.5 ms of H200 bytes
]


def test_roofline_sums_each_items_limit_and_divides_the_step_by_it():
    r = ps.roofline(report("t2i-cfg", "NVIDIA H200", [12.0, 10.0, 11.0], KERNELS, WORK))
    limits = {kind: e["limit_ms"] for kind, e in r["kinds"].items()}
    assert limits == pytest.approx(
        {"fp8 gemm": 2.0, "bf16 gemm": 2.0, "attention": 2.0, "producers (ours)": 0.5, "other": None}
    )
    assert r["unmodeled"] == ["other"]
    assert (r["step_ms"], r["kernel_ms"], r["limit_ms"]) == pytest.approx((11.0, 10.1, 6.5))
    assert r["step_over_limit"] == pytest.approx(11.0 / 6.5)
    on_h100 = ps.roofline(report("qi21-cfg", "NVIDIA H100 80GB HBM3", [5.0], KERNELS, WORK))
    assert on_h100["kinds"]["producers (ours)"]["limit_ms"] == pytest.approx(2.4 / 3.35)


def test_merged_table_from_stored_reports(tmp_path, monkeypatch, capsys):
    """`--tables-from` over several reports: each one's Markdown rewritten, the merged table in the declared
    order with each request's step / limit."""
    h100_work = [item("fp8 gemm", 1.979e12, 0), item("producers (ours)", 0, 3.35e9)]  # 1 + 1 ms on an H100
    paths = []
    for name, stored in (
        ("qi21-cfg", report("qi21-cfg", "NVIDIA H100 80GB HBM3", [4.0, 5.0, 6.0], KERNELS[:1], h100_work)),
        ("t2i-cfg", report("t2i-cfg", "NVIDIA H200", [12.0, 10.0, 11.0], KERNELS, WORK)),
    ):
        paths.append(tmp_path / f"profile_fp8-fused-graph_{name}.json")
        paths[-1].write_text(json.dumps(stored))
    argv = ["profile_step.py", "--tables-from", *map(str, paths), "--out", str(tmp_path / "merged")]
    monkeypatch.setattr(sys, "argv", argv)
    ps.main()
    merged = (tmp_path / "merged" / "roofline.md").read_text()
    assert merged == capsys.readouterr().out
    headline = [
        line for line in merged.splitlines() if line.startswith(("| t2i-cfg | 2 x", "| qi21-cfg | 2 x"))
    ]
    assert headline == [
        "| t2i-cfg | 2 x 1024x1 | 11.0 | 10.1 | 6.5 | 1.69x | 1.55x |",
        "| qi21-cfg | 2 x 1024x1 | 5.0 | 4.0 | 2.0 | 2.50x | 2.00x |",
    ]
    assert "| t2i-cfg | bf16 gemm | 2.00 | 2 | 0.99 | 4.80 | 495 | 2400 | 50% | 50% | 2.00 | 1.00 |" in merged
    assert "different devices" in merged
    assert "**1.69x**" in paths[1].with_suffix(".md").read_text()


def test_a_report_from_before_the_byte_counts_still_renders(tmp_path):
    stored = REPO / "bench/results/2026-12-04-h200-session17/call5_profile_fp8-fused-graph_1024x1.json"
    summary = ps.write_tables(json.loads(stored.read_text()), tmp_path / "old.md")
    assert "| fp8 gemm | 33.98 | 660 | 38.85 |" in summary
    assert ps.roofline(json.loads(stored.read_text()))["limit_ms"] is None  # no bytes: no limit claimed


def test_benchmarks_roofline_table_is_what_its_raw_reports_give() -> None:
    """BENCHMARKS.md's roofline per request (session 22) is the merged table of the four stored request
    reports, as the device printed it (`roofline.md`, read by the summary row's claims in bench/claims.py)."""
    from bench.claims import ROOFLINE

    folder = REPO / ROOFLINE.rsplit("/", 1)[0]
    requests = ("t2i-cfg", "lightning4", "edit2511-cfg", "qi21-cfg")
    reports = [json.loads((folder / f"profile_fp8-fused-graph_{r}.json").read_text()) for r in requests]
    printed = ps.merged_table(reports)
    assert printed == (REPO / ROOFLINE).read_text().strip()
    assert printed in (REPO / "BENCHMARKS.md").read_text()
