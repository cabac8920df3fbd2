"""q/k RMSNorm + RoPE: the twin vs the contract and vs diffusers; Triton (interpreter) vs the contract;
guards, every launch variant, and the sm_90 PTX of the kernel (compiled here, no GPU needed).

`contract_from_sum` below restates the rounding contract of kernels/qk_norm_rope.py for a given sum of
squares and a given fp32 -> bf16 rounding: nearest-even (the contract) or truncation (what Triton's CPU
interpreter does, DESIGN §4); it runs on CPU and CUDA tensors, with the machine-independent sqrt and
division of kernels/fp32.py (checked in tests/test_machine_independent.py). `explained_by_sum_order`
then checks, row by row, that a kernel's output is the contract's for a sum of squares a few fp32 ulps
from the twin's pinned-order sum: the only freedom the contract leaves (the order of the sum). The twin
itself is compared with the numpy emulation of tests/contract.py.
"""

import json
import platform

import contract
import pytest
import torch
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
from ptx_probe import ptx_counts, record_launches, report_from_subprocess
from steps import step_distance
from test_kernels_quant import all_bf16, needs_interpreter

from qwen_image_fusion.kernels.fp32 import div_rn, row_sum, sqrt_rn
from qwen_image_fusion.kernels.qk_norm_rope import (
    MAX_HEAD_DIM,
    rms_norm_rope,
    rms_norm_rope_torch,
    rms_norm_rope_triton,
)
from qwen_image_fusion.models.qwen_image import transformer
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer

EPS = 1e-6
SUM_ULPS = 8  # how far (fp32 ulps) another order may move a sum of D <= 512 squares in these tests
# (batch, tokens, heads, head_dim): the embedded model's head_dim, the real one, a wide one; few rows
# (the interpreter costs ~3 ms a program)
SHAPES = [(2, 5, 3, 32), (1, 3, 4, 128), (1, 2, 1, MAX_HEAD_DIM)]
TINY = QwenImageConfig(
    num_layers=1,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=48,
    axes_dims_rope=(8, 12, 12),
)


def nearest_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def truncated_bf16(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 toward zero, as Triton's interpreter converts normal values."""
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def contract_from_sum(x, sum_sq, weight, cos, sin, to_bf16) -> torch.Tensor:
    """The contract from the fp32 sum of squares on: rstd, n, w, then the rotated pairs (x [..., D];
    sum_sq [..., 1]; cos / sin broadcastable to [..., D/2])."""
    rstd = div_rn(torch.ones_like(sum_sq), sqrt_rn(div_rn(sum_sq, x.shape[-1]) + EPS))
    n = to_bf16(x.float() * rstd)
    w = to_bf16(n.float() * weight.float()).float()
    a, b = w[..., 0::2], w[..., 1::2]
    real, imag = to_bf16(a * cos - b * sin), to_bf16(a * sin + b * cos)
    return torch.stack([real, imag], dim=-1).flatten(-2)


def same_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., 1] mask of rows (last dim) with identical bytes, NaN matching any NaN (a GPU writes its own)."""
    same = (a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())
    return same.all(-1, keepdim=True)


def explained_by_sum_order(got, x, weight, rope, to_bf16=nearest_bf16, ulps=SUM_ULPS):
    """(explained, exact): [B, S, H, 1] masks of the rows of `got` equal to the contract for some sum of
    squares within `ulps` fp32 ulps of the twin's, and for the twin's sum itself."""
    xf = x.float()
    codes = row_sum(xf * xf).view(torch.int32)
    cos, sin = rope[..., 0].unsqueeze(1), rope[..., 1].unsqueeze(1)
    exact = same_rows(got, contract_from_sum(x, codes.view(torch.float32), weight, cos, sin, to_bf16))
    explained = exact.clone()
    if bool(exact.all()):
        return explained, exact
    b, s, h, _ = (~exact).nonzero(as_tuple=True)  # retry only the rows that differ
    rows_x, rows_got, rows_codes = x[b, s, h], got[b, s, h], codes[b, s, h]
    for j in range(-ulps, ulps + 1):
        sum_sq = (rows_codes + j).clamp(min=0).view(torch.float32)
        want = contract_from_sum(rows_x, sum_sq, weight, rope[s, :, 0], rope[s, :, 1], to_bf16)
        explained[b, s, h] |= same_rows(rows_got, want)
    return explained, exact


def make_inputs(batch, seq, heads, dim, seed=0, exact_sums=False):
    """x as the `unflatten` view of a [B, S, H*D] projection output, rows of varied scale; weight near 1;
    rope = view_as_real of unit complex rotations at random angles.

    `exact_sums`: x = k * 2^e with |k| < 256 and one e per row, so every partial sum of squares is an
    integer multiple of 2^(2e) below 2^24 of them: exact in fp32 in any order.
    """
    g = torch.Generator().manual_seed(seed)
    if exact_sums:
        k = torch.randint(-255, 256, (batch, seq, heads, dim), generator=g).float()
        x = k * torch.exp2(torch.randint(-12, 4, (batch, seq, heads, 1), generator=g).float())
    else:
        spread = torch.exp(2 * torch.randn(batch, seq, heads, 1, generator=g))
        x = torch.randn(batch, seq, heads, dim, generator=g) * spread
    angles = 40 * torch.randn(seq, dim // 2, generator=g)
    return {
        "x": x.bfloat16().flatten(2).unflatten(-1, (heads, dim)),
        "weight": (1 + 0.2 * torch.randn(dim, generator=g)).bfloat16(),
        "rope": torch.view_as_real(torch.polar(torch.ones_like(angles), angles)),
    }


def joint_buffer(t: dict, text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled joint [B, text + S, H, D] buffer and its image rows (the slice after `text` rows)."""
    b, s, h, d = t["x"].shape
    joint = torch.full((b, text + s, h, d), float("nan"), dtype=torch.bfloat16)
    return joint, joint[:, text:]


@pytest.mark.numerics
def test_twin_is_the_contract():
    """Bit for bit the numpy emulation (tests/contract.py), on rows of every scale and on every bf16
    encoding (zeros, subnormals, inf, NaN) as x and, row by row, as the weight."""
    bits = contract.bf16_bits
    t = make_inputs(2, 16, 3, 128, seed=1)
    x, rope = t["x"], t["rope"]
    want = contract.as_bf16(contract.rms_norm_rope(bits(x), bits(t["weight"]), rope.numpy(), EPS))
    got = rms_norm_rope_torch(x, t["weight"], rope, EPS)
    assert got.dtype == torch.bfloat16
    contract.assert_same_encodings(got, want, "random rows")
    joint, image = joint_buffer(t, text=4)
    assert rms_norm_rope_torch(x, t["weight"], rope, EPS, out=image) is image
    assert bool(same_rows(image, want).all()) and bool(joint[:, :4].isnan().all())

    every = all_bf16().view(2, 16, 16, 128)
    rope = make_inputs(2, 16, 16, 128, seed=2)["rope"]
    # weights: the rows (one sign and exponent each) of -0 and negative subnormals, -inf and NaN, +0 and
    # subnormals, values near 1, huge values, +inf and NaN
    for weight in every.view(-1, 128)[[0, 255, 256, 383, 500, 511]]:
        emulated = contract.rms_norm_rope(bits(every), bits(weight), rope.numpy(), EPS)
        got = rms_norm_rope_torch(every, weight, rope, EPS)
        contract.assert_same_encodings(got, contract.as_bf16(emulated), "every encoding")


def complex_multiply_rounds_each_product() -> bool:
    """Whether torch's complex64 multiply on this machine rounds each product before adding (torch's x86
    kernels do; a compiler may contract `a*c - b*d` into an FMA elsewhere, e.g. on aarch64)."""
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(4096, 2, generator=g), torch.randn(4096, 2, generator=g)
    product = torch.view_as_real(torch.view_as_complex(u) * torch.view_as_complex(v))
    real = u[:, 0] * v[:, 0] - u[:, 1] * v[:, 1]
    imag = u[:, 0] * v[:, 1] + u[:, 1] * v[:, 0]
    return torch.equal(product, torch.stack([real, imag], dim=-1))


@pytest.mark.numerics
@pytest.mark.parametrize("shape", [(2, 64, 24, 128), (2, 1024, 4, 32)])
def test_twin_vs_diffusers(shape):
    """diffusers: `RMSNorm` (x * rsqrt(mean(x^2) + eps) in fp32, to bf16, times the bf16 weight), then
    `apply_rotary_emb_qwen(use_real=False)` (complex64 multiply), all torch ops of this machine.
    On any machine: where the twin's rstd (pinned sum, 1/sqrt) differs from diffusers' (torch's mean,
    rsqrt), n may move one bf16 step, and an FMA in the complex multiply moves the rotated value by less
    than one, so each output is within 3 * 2^-7 * (|a| + |b|) of diffusers' (a, b: the pair diffusers
    rotates). Where diffusers' complex multiply rounds each product (torch's x86 kernels, checked), the
    contract with diffusers' rstd gives diffusers' bytes everywhere, so the twin's bytes are diffusers' in
    every row where the two rstd agree."""
    t = make_inputs(*shape, seed=2)
    x, weight, rope = t["x"], t["weight"], t["rope"]
    norm = RMSNorm(shape[-1], eps=EPS).bfloat16().requires_grad_(False)
    norm.weight.copy_(weight)
    normed = norm(x)
    expected = apply_rotary_emb_qwen(normed, torch.view_as_complex(rope), use_real=False)
    got = rms_norm_rope_torch(x, weight, rope, EPS)

    pair = normed.float().abs().unflatten(-1, (-1, 2)).sum(-1).repeat_interleave(2, dim=-1)
    assert bool(((got.float() - expected.float()).abs() <= 3 * 2.0**-7 * pair).all())

    xf = x.float()
    diffusers_rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    twin_rstd = div_rn(torch.ones_like(diffusers_rstd), sqrt_rn(div_rn(row_sum(xf * xf), shape[-1]) + EPS))
    other_rstd = twin_rstd != diffusers_rstd
    cos, sin = rope[..., 0][:, None], rope[..., 1][:, None]
    n = (xf * diffusers_rstd).bfloat16()  # the contract from n on, with diffusers' rstd
    w = (n.float() * weight.float()).bfloat16().float()
    a, b = w[..., 0::2], w[..., 1::2]
    replay = torch.stack([(a * cos - b * sin), (a * sin + b * cos)], dim=-1).flatten(-2).bfloat16()
    separate = complex_multiply_rounds_each_product()
    assert separate or platform.machine() not in ("x86_64", "AMD64")
    if separate:
        assert bool(same_rows(replay, expected).all())
        assert bool(same_rows(got, expected)[~other_rstd].all())
    print(f"{shape}: {int(other_rstd.sum())} of {other_rstd.numel()} rows where the rstd differ, "
          f"{int((step_distance(got, expected) > 0).sum())} values differ")  # fmt: skip


@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("exact_sums", [True, False], ids=["exact-sums", "random"])
def test_triton_is_the_contract(shape, exact_sums):
    """Interpreter vs the contract with its truncating conversion: with sums exact in any order, every row
    equal; otherwise every row explained by a sum order (the GPU suite checks the nearest-even bytes)."""
    t = make_inputs(*shape, seed=shape[-1], exact_sums=exact_sums)
    joint, image = joint_buffer(t, text=3)
    assert rms_norm_rope_triton(t["x"], t["weight"], t["rope"], EPS, out=image) is image
    assert bool(joint[:, :3].isnan().all())  # the text rows are untouched
    explained, exact = explained_by_sum_order(image, t["x"], t["weight"], t["rope"], truncated_bf16)
    assert bool(explained.all())
    if exact_sums:
        assert bool(exact.all())
    fresh = rms_norm_rope_triton(t["x"], t["weight"], t["rope"], EPS)
    assert fresh.is_contiguous() and bool(same_rows(fresh, image).all())


def _inputs_with(**changes) -> dict:
    t = make_inputs(2, 3, 2, 32)
    t.update(changes)
    return t


def _out(shape=(2, 3, 2, 32), dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@needs_interpreter
@pytest.mark.parametrize(
    "t, out",
    [
        (_inputs_with(x=torch.randn(2, 3, 2, 32)), None),  # fp32 x
        (_inputs_with(x=torch.randn(2, 3, 32, 2).bfloat16().transpose(2, 3)), None),  # D not unit-stride
        (_inputs_with(x=torch.randn(6, 2, 32).bfloat16()), None),  # 3-D x
        (_inputs_with(x=torch.empty(2, 0, 2, 32, dtype=torch.bfloat16)), None),  # no tokens
        (make_inputs(1, 2, 1, 24), None),  # D not a power of two
        (make_inputs(1, 2, 1, 8), None),  # D below 16
        (make_inputs(1, 2, 1, 2 * MAX_HEAD_DIM), None),  # D above 512
        (_inputs_with(weight=torch.ones(32)), None),  # fp32 weight
        (_inputs_with(weight=torch.ones(64, dtype=torch.bfloat16)[::2]), None),  # weight not unit-stride
        (_inputs_with(weight=torch.ones(16, dtype=torch.bfloat16)), None),  # weight of another width
        (_inputs_with(rope=torch.ones(3, 16, 2, dtype=torch.bfloat16)), None),  # bf16 rope
        (_inputs_with(rope=torch.ones(4, 16, 2)), None),  # rope for another sequence length
        (_inputs_with(rope=torch.ones(3, 2, 16).transpose(1, 2)), None),  # cos and sin not adjacent
        (_inputs_with(rope=torch.ones(3, 16, 2, device="meta")), None),  # rope on another device
        (make_inputs(2, 3, 2, 32), _out(dtype=torch.float32)),  # fp32 out
        (make_inputs(2, 3, 2, 32), _out((2, 4, 2, 32))),  # out of another shape
        (make_inputs(2, 3, 2, 32), _out((2, 3, 32, 2)).transpose(2, 3)),  # out not unit-stride on D
        (make_inputs(2, 3, 2, 32), _out(device="meta")),  # out on another device
    ],
)
def test_guard_rejects(t, out):
    assert rms_norm_rope_triton(t["x"], t["weight"], t["rope"], EPS, out) is None


def test_dispatch_on_cpu_is_the_torch_twin():
    t = make_inputs(2, 7, 3, 128, seed=3)
    got = rms_norm_rope(t["x"], t["weight"], t["rope"], EPS)
    assert bool(same_rows(got, rms_norm_rope_torch(t["x"], t["weight"], t["rope"], EPS)).all())
    joint, image = joint_buffer(t, text=2)
    assert rms_norm_rope(t["x"], t["weight"], t["rope"], EPS, out=image) is image
    assert bool(same_rows(image, got).all()) and bool(joint[:, :2].isnan().all())


def _variants():
    """(name, inputs, out or None): every kind of launch the model and the tests make."""
    text = make_inputs(2, 3, 2, 32, seed=4)
    image = make_inputs(2, 5, 2, 32, seed=5)
    joint = torch.empty(2, 8, 2, 32, dtype=torch.bfloat16)
    contiguous = make_inputs(1, 2, 3, 128, seed=6)
    contiguous["x"] = contiguous["x"].contiguous()
    return [
        ("text rows of a joint buffer", text, joint[:, :3]),
        ("image rows of a joint buffer", image, joint[:, 3:]),
        ("new output, contiguous x", contiguous, None),
        ("one row", make_inputs(1, 1, 1, 16, seed=7), None),
        ("widest", make_inputs(1, 1, 1, MAX_HEAD_DIM, seed=8), None),
    ]


@needs_interpreter
@pytest.mark.parametrize("name, t, out", _variants(), ids=[v[0] for v in _variants()])
def test_every_variant_launches(name, t, out):
    got = rms_norm_rope_triton(t["x"], t["weight"], t["rope"], EPS, out)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == t["x"].shape, name
    assert out is None or got is out
    assert bool(explained_by_sum_order(got, t["x"], t["weight"], t["rope"], truncated_bf16)[0].all())


def test_contract_attention_writes_the_twin_into_the_joint_sequence(monkeypatch):
    """JointAttention in contract numerics: q and k are the twin's rows, text then image, one buffer each."""
    torch.manual_seed(0)
    model = QwenImageTransformer(TINY).bfloat16()
    model.set_numerics("contract")
    attn = model.transformer_blocks[0].attn
    assert all(
        m.numerics == "contract" for m in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
    )
    with torch.no_grad():
        for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
            norm.weight.normal_(1.0, 0.2)
    seen = {}

    def capture(query, key, value, key_mask):
        seen.update(query=query, key=key)
        return query

    monkeypatch.setattr(transformer, "joint_attention", capture)
    img, txt = torch.randn(2, 6, 64).bfloat16(), torch.randn(2, 3, 64).bfloat16()
    rope = model.rope((1, 2, 3), 3, torch.device("cpu"))
    with torch.no_grad():
        attn(img, txt, None, rope)
        for name, txt_proj, img_proj, txt_norm, img_norm in [
            ("query", attn.add_q_proj, attn.to_q, attn.norm_added_q, attn.norm_q),
            ("key", attn.add_k_proj, attn.to_k, attn.norm_added_k, attn.norm_k),
        ]:
            txt_rows = rms_norm_rope_torch(
                txt_proj(txt).unflatten(-1, (2, 32)), txt_norm.weight, rope.txt, EPS
            )
            img_rows = rms_norm_rope_torch(
                img_proj(img).unflatten(-1, (2, 32)), img_norm.weight, rope.img, EPS
            )
            assert torch.equal(seen[name], torch.cat([txt_rows, img_rows], dim=1)), name
    assert model.rope((1, 2, 3), 3, torch.device("cpu")) is rope  # cached: nothing recomputed per step


def compile_report() -> dict:
    """The model's launch (D = 128, x a strided projection view, out a joint-buffer slice) recorded, not
    run, and compiled for sm_90: PTX instruction counts, with fp fusion off (as launched) and on (probe)."""
    from qwen_image_fusion.kernels import qk_norm_rope

    qk_norm_rope.launchable = lambda kernel, *tensors: True  # CPU tensors stand in for CUDA ones
    kernel = qk_norm_rope._rms_norm_rope_kernel
    calls = record_launches(kernel)
    t = make_inputs(2, 8, 24, 128)
    out = torch.empty(2, 12, 24, 128, dtype=torch.bfloat16)[:, 4:]
    qk_norm_rope.rms_norm_rope_triton(t["x"], t["weight"], t["rope"], EPS, out)
    ((args, kwargs),) = calls
    return ptx_counts(kernel, args, kwargs)


def test_ptx_follows_the_contract():
    ptx = report_from_subprocess(__file__)
    assert ptx["fma"] == 0 and ptx["fma_if_fusion_allowed"] > 0  # the rope's a*cos - b*sin would contract
    assert ptx["div_inexact"] == 0 and ptx["inexact_sqrt_or_rcp"] == 0 and ptx["ftz"] == 0
    assert ptx["sqrt_rn"] > 0 and ptx["div_rn"] > 0 and ptx["cvt_bf16"] > 0
    assert ptx["div_rn"] == 2 * ptx["sqrt_rn"]  # per row a thread holds: sum / D, 1 / sqrt


if __name__ == "__main__":
    print(json.dumps(compile_report()))
