"""bench/nvfp4_quality_gpu.py end to end at toy sizes on the CPU (the GPU stage `nvfp4-quality` runs it at
full size): every row is in the report with finite metrics, the BF16 pipeline run twice compares identical (a
metric or pairing mistake shows there), and NVFP4's 4-bit blocks move the image away from BF16's."""

import json
import math

from bench.nvfp4_quality_gpu import ROWS, main

METRICS = ("psnr_db", "ssim")


def test_tiny_run_reports_every_row(tmp_path) -> None:
    out = tmp_path / "quality.json"
    args = ["--tiny", "--layers", "6", "--size", "64x64", "--steps", "2", "--max-prompts", "2"]
    assert main([*args, "--seeds", "0", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "meaningless" in report["note"]
    assert report["settings"]["layers"] == 6 and report["settings"]["steps"] == 2
    rows = report["rows"]
    assert set(rows) == {row.name for row in ROWS}
    for name, row in rows.items():
        assert len(row["pairs"]) == 2, name
        for metric in METRICS:
            assert set(row[metric]) >= {"min", "median", "max"}, (name, metric)
    repeat = rows["bf16-repeat"]
    assert repeat["identical"] == 2
    assert all(p["psnr_db"] == "inf" and p["ssim"] == 1.0 for p in repeat["pairs"])
    for name in ("fp8", "nvfp4", "nvfp4-every-block", "nvfp4-against-fp8", "nvfp4-every-block-against-fp8"):
        for pair in rows[name]["pairs"]:
            assert not pair["identical"], name
            assert math.isfinite(pair["psnr_db"]) and 0 < pair["ssim"] < 1, (name, pair)
    builds = report["builds"]
    assert builds["nvfp4"]["quantized_blocks"] == "2 of 6"  # quantize's default keeps blocks 0, 1, 4, 5
    assert builds["nvfp4-every-block"]["quantized_blocks"] == "6 of 6"
    assert builds["nvfp4"]["variant"] == "nvfp4" and builds["fp8"]["variant"] == "fp8-fused"
    assert "e2m1" in builds["nvfp4-every-block"]["parameters"]
