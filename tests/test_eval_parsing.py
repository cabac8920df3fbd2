"""Command-line grammars of eval/: variants, --expect, prompt sets, seeds and sizes."""

import math

import pytest

from qwen_image_fusion.eval.expect import judge, parse_expect
from qwen_image_fusion.eval.parity import parse_seeds, parse_size
from qwen_image_fusion.eval.prompts import builtin_sets, load_prompts, parse_prompts
from qwen_image_fusion.eval.variants import VariantSpec, parse_variant
from qwen_image_fusion.models.errors import InputError

KNOWN = ("reference", "contract", "fp8-unfused", "fp8-fused", "auto")


@pytest.mark.parametrize(
    ("text", "name", "device", "dtype"),
    [
        ("contract", "contract", None, None),
        ("fp8-fused:cuda", "fp8-fused", "cuda", None),
        ("contract:cuda:bf16", "contract", "cuda", "bf16"),
        ("reference:cpu:fp32", "reference", "cpu", "fp32"),
        ("fp8-unfused:cuda:1:bf16", "fp8-unfused", "cuda:1", "bf16"),
        ("auto:fp32", "auto", None, "fp32"),
    ],
)
def test_variant_grammar(text: str, name: str, device: str | None, dtype: str | None) -> None:
    assert parse_variant(text, KNOWN) == VariantSpec(text=text, name=name, device=device, dtype=dtype)


@pytest.mark.parametrize(
    "text", ["nope", "contract:gpu", "contract:bf16:cuda", "contract:cpu:1", "contract:cuda:bf16:1", ""]
)
def test_bad_variants_raise_input_error(text: str) -> None:
    with pytest.raises(InputError, match="variant"):
        parse_variant(text, KNOWN)


def pair(index: int, **metrics: float | None) -> dict:
    row = {"id": f"p{index:03d}-s0", "identical": False, "psnr_db": 40.0, "ssim": 0.99}
    row.update(lpips=None, max_abs_diff=3, mean_abs_diff=0.5)
    return {**row, **metrics}


def test_expect_terms_and_verdicts() -> None:
    terms = parse_expect("psnr>=35, SSIM >= 0.98,max_abs<=3")
    assert [(t.metric, t.op, t.value) for t in terms] == [
        ("psnr", ">=", 35),
        ("ssim", ">=", 0.98),
        ("max_abs", "<=", 3),
    ]
    good = judge(terms, [pair(0), pair(1, psnr_db=math.inf, identical=True)])
    assert good.passed and good.line == "verdict: PASS (psnr>=35,ssim>=0.98,max_abs<=3 on all 2 pairs)"
    bad = judge(terms, [pair(0, psnr_db=30.0), pair(1, psnr_db=20.5), pair(2)])
    assert not bad.passed
    assert bad.line == "verdict: FAIL (psnr>=35 failed on 2/3 pairs (worst: 20.5 at p001-s0))"


def test_expect_identical_and_lpips_unavailable() -> None:
    verdict = judge(parse_expect("identical"), [pair(0, identical=True), pair(1)])
    assert verdict.line == "verdict: FAIL (identical failed on 1/2 pairs (first: p001-s0))"
    assert judge(parse_expect("lpips<0.1"), [pair(0)]).failures == [
        "lpips<0.1 failed on 1/1 pairs (worst: unavailable at p000-s0)"
    ]


@pytest.mark.parametrize("text", ["same", "psnr>>35", "psnr>=", "fid<3", "psnr>=35;ssim>=1", ""])
def test_bad_expect_raises_input_error(text: str) -> None:
    with pytest.raises(InputError, match="--expect"):
        parse_expect(text)


def test_prompt_sets() -> None:
    assert {"smoke", "diverse"} <= set(builtin_sets())
    diverse = load_prompts("diverse")
    assert len(diverse) >= 40 and len(set(diverse)) == len(diverse)
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in p) for p in diverse)  # Chinese text rendering
    assert any(len(p) > 200 for p in diverse)  # long prompts
    assert 3 <= len(load_prompts("smoke")) <= 8
    assert parse_prompts("# comment\n\n  a cat #1 \n   # indented comment\nb\n") == ["a cat #1", "b"]


def test_prompt_file_errors(tmp_path) -> None:
    with pytest.raises(InputError, match="prompt file not found"):
        load_prompts(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n", encoding="utf-8")
    with pytest.raises(InputError, match="no prompts"):
        load_prompts(str(empty))
    mine = tmp_path / "mine.txt"
    mine.write_text("一只猫\nA dog\n", encoding="utf-8")
    assert load_prompts(str(mine)) == ["一只猫", "A dog"]


def test_seeds_and_size() -> None:
    assert parse_seeds("0,1,7") == [0, 1, 7]
    assert parse_size("64x48") == (64, 48) and parse_size(None) == (None, None)
    for bad in ("a", "1,1", "-1"):
        with pytest.raises(InputError, match="--seeds"):
            parse_seeds(bad)
    for bad in ("64", "64x", "x64", "64*64"):
        with pytest.raises(InputError, match="--size"):
            parse_size(bad)
