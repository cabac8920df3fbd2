"""qwen_image_fusion.eval.report: strict JSON with inf, the summary, worst-first order and the HTML page."""

import json
import math
from html.parser import HTMLParser

from qwen_image_fusion.eval.report import (
    decode_pair,
    encode,
    render_html,
    summarize,
    summary_lines,
    worst_first,
    write_json,
)


def pair(index: int, identical: bool, psnr: float, ssim: float) -> dict:
    side = {"image": f"images/p{index:03d}-s0-a.png", "pixel_sha256": "ab" * 32, "seconds": 1.0 + index}
    return {
        "index": index, "id": f"p{index:03d}-s0", "prompt": f"<prompt {index}>", "seed": 0,
        "a": side, "b": {**side, "image": f"images/p{index:03d}-s0-b.png"},
        "identical": identical, "png_identical": identical, "psnr_db": psnr, "ssim": ssim, "lpips": None,
        "max_abs_diff": 0 if identical else 4, "mean_abs_diff": 0.0 if identical else 0.25,
        "diff_image": None if identical else f"images/p{index:03d}-s0-diff.png",
        "diff_gain": None if identical else 63.75,
    }  # fmt: skip


PAIRS = [pair(0, True, math.inf, 1.0), pair(1, False, 38.0, 0.99), pair(2, False, 31.5, 0.97)]


def test_inf_is_written_as_a_string_and_read_back(tmp_path) -> None:
    assert encode({"x": [math.inf, -math.inf, 1.5], "y": "inf"}) == {"x": ["inf", "-inf", 1.5], "y": "inf"}
    write_json({"pairs": PAIRS}, tmp_path / "r.json")
    text = (tmp_path / "r.json").read_text()
    assert "Infinity" not in text
    loaded = json.loads(text)["pairs"][0]
    assert loaded["psnr_db"] == "inf" and decode_pair(loaded)["psnr_db"] == math.inf
    assert decode_pair(loaded)["prompt"] == "<prompt 0>"


def test_summary_and_order() -> None:
    summary = summarize(PAIRS)
    assert summary["pairs"] == 3 and summary["identical"] == 1
    assert summary["metrics"]["psnr_db"] == {"min": 31.5, "median": 38.0, "max": math.inf}
    assert summary["metrics"]["lpips"] is None
    assert summary["time"]["a"] == {"median_s": 2.0, "total_s": 6.0}
    assert [p["index"] for p in worst_first(PAIRS)] == [2, 1, 0]


class Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_html_lists_pairs_worst_first_with_escaped_prompts() -> None:
    worker = {"fusion_summary": "FP8 norm+quant fusion: off"}
    report = {
        "model": {"a": "embedded-default", "b": "embedded-default"},
        "prompts": {"source": "smoke", "count": 3},
        "settings": {"seeds": [0], "width": 64, "height": 64, "steps": 2},
        "variants": {
            "a": {"spec": "contract", "workers": [worker]},
            "b": {"spec": "reference", "workers": [worker]},
        },
        "lpips": {"available": False, "reason": "no torchvision"},
        "pairs": PAIRS, "summary": summarize(PAIRS),
        "expect": {"spec": "identical", "passed": False, "line": "verdict: FAIL (identical failed)"},
    }  # fmt: skip
    page = render_html(report)
    parser = Collector()
    parser.feed(page)
    assert parser.images == [
        "images/p002-s0-a.png", "images/p002-s0-b.png", "images/p002-s0-diff.png",
        "images/p001-s0-a.png", "images/p001-s0-b.png", "images/p001-s0-diff.png",
        "images/p000-s0-a.png", "images/p000-s0-b.png",
    ]  # fmt: skip
    text = "".join(parser.text)
    assert "<prompt 2>" in text and "LPIPS: unavailable (no torchvision)" in text and "verdict: FAIL" in text
    assert "LPIPS: unavailable (no torchvision)" in summary_lines(report)
