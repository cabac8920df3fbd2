"""End to end: `python -m qwen_image_fusion.eval.parity` on the real embedded default model (tiny sizes, 2
steps)."""

import json
import math
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from qwen_image_fusion.eval.parity import main

REPO = Path(__file__).resolve().parents[1]
FAST = ["--size", "64x64", "--steps", "2"]


def parity(*args: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", *launcher, "qwen_image_fusion.eval.parity", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "two.txt"
    path.write_text("# two prompts\nA red apple on a table\n一只猫坐在窗台上\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def differing_run(
    prompts: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("differing")
    result = parity("--prompts", str(prompts), "--a", "reference", "--b", "contract", "--seeds", "0,1", *FAST,
                    "--out", str(out), "--expect", "identical")  # fmt: skip
    return result, out


def load(out: Path) -> dict:
    return json.loads((out / "report.json").read_text(encoding="utf-8"))


@pytest.mark.cpu_dtype
@pytest.mark.slow
def test_reference_vs_contract_differs(differing_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    result, out = differing_run
    assert result.returncode == 1, result.stderr
    assert "verdict: FAIL (identical failed on" in result.stdout
    report = load(out)
    assert report["summary"]["pairs"] == 4 and report["summary"]["identical"] < 4
    differing = [p for p in report["pairs"] if not p["identical"]]
    for pair in differing:
        assert isinstance(pair["psnr_db"], float) and math.isfinite(pair["psnr_db"])
        assert pair["ssim"] < 1.0 and pair["max_abs_diff"] > 0
        assert pair["a"]["pixel_sha256"] != pair["b"]["pixel_sha256"]
    assert report["variants"]["a"]["workers"][0]["variant"] == "reference"
    assert report["variants"]["b"]["workers"][0]["variant"] == "contract"
    assert report["summary"]["time"]["a"]["total_s"] > 0
    assert [p["order"] for p in report["pairs"]] == ["ab", "ba", "ab", "ba"]


class ImageSources(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.sources.append(dict(attrs)["src"])


@pytest.mark.slow
def test_html_references_every_image(differing_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    _, out = differing_run
    report = load(out)
    parser = ImageSources()
    parser.feed((out / "report.html").read_text(encoding="utf-8"))
    parser.close()
    expected = {p[side]["image"] for p in report["pairs"] for side in "ab"}
    expected |= {p["diff_image"] for p in report["pairs"] if p["diff_image"]}
    assert set(parser.sources) == expected and len(parser.sources) == len(expected)
    assert all((out / source).is_file() for source in parser.sources)
    assert sorted(path.name for path in (out / "images").iterdir()) == sorted(Path(s).name for s in expected)


@pytest.mark.slow
def test_lpips_unavailable_reason_is_printed(differing_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    result, out = differing_run
    lpips = load(out)["lpips"]
    if lpips["available"]:
        pytest.skip("LPIPS weights and torchvision are present here")
    assert lpips["reason"] and f"LPIPS: unavailable ({lpips['reason']})" in result.stdout
    assert all(p["lpips"] is None for p in load(out)["pairs"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--prompts", "no/such/file.txt", "--a", "contract", "--b", "contract"],
            "error: prompt file not found",
        ),
        (["--a", "contract", "--b", "fp9"], "error: unknown variant 'fp9'"),
        (["--a", "contract:cuda:bf16:2", "--b", "contract"], "error: bad variant"),
        (["--a", "contract", "--b", "contract", "--expect", "psnr=>35"], "error: bad --expect term"),
        (
            ["--a", "contract", "--b", "contract", "--expect", "lpips<0.1", "--lpips-weights", "/no/such"],
            "error: --expect uses lpips",
        ),
        (["--a", "contract", "--b", "contract", "--size", "64"], "error: bad --size"),
    ],
)
def test_usage_errors_print_one_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "report.json").exists()


@pytest.mark.cpu_dtype
@pytest.mark.slow
def test_worker_errors_print_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint error raised inside a worker (weights unreadable past headers that inspect accepts)
    reaches the user as one line, exit status 2."""
    broken = embedded_copy(tmp_path / "broken")
    weights = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    argv = ["--model", str(broken), "--a", "contract", "--b", "reference", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: variant a (contract): ") and str(weights) in err and err.count("\n") == 1


def test_a_directory_that_is_no_checkpoint_is_refused_before_workers(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    assert main(["--model", str(empty), "--a", "contract", "--b", "reference", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: missing {empty / 'model_index.json'}\n"
    assert not (tmp_path / "report.json").exists()


def embedded_copy(directory: Path) -> Path:
    """A copy of the embedded default checkpoint at `directory`."""
    from qwen_image_fusion.models.embedded import DEFAULT_MODEL_DIR

    shutil.copytree(DEFAULT_MODEL_DIR, directory)
    return directory


@pytest.mark.cpu_dtype
@pytest.mark.slow
def test_torchrun_two_gloo_ranks_contract_vs_contract_is_identical(prompts: Path, tmp_path: Path) -> None:
    """Two gloo ranks share 4 pairs; rank 0 merges them; contract vs contract is bit-identical."""
    launcher = ("torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m")
    result = parity("--prompts", str(prompts), "--a", "contract", "--b", "contract:cpu", "--seeds", "0,1",
                    *FAST, "--out", str(tmp_path), "--expect", "identical", launcher=launcher)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verdict: PASS (identical on all 4 pairs)" in result.stdout
    assert "[rank 1] pair 4/4 p001-s1 b=contract:cpu" in result.stderr
    report = load(tmp_path)
    assert report["world_size"] == 2 and report["model"] == {"a": "embedded-default", "b": "embedded-default"}
    assert [p["index"] for p in report["pairs"]] == [0, 1, 2, 3]
    assert [p["rank"] for p in report["pairs"]] == [0, 1, 0, 1]
    assert [w["rank"] for w in report["variants"]["b"]["workers"]] == [0, 1]
    for rank in (0, 1):
        shard = json.loads((tmp_path / f"shard-{rank}.json").read_text(encoding="utf-8"))
        assert [p["index"] for p in shard["pairs"]] == [rank, rank + 2]
    assert report["summary"]["identical"] == 4 and report["expect"]["passed"] is True
    for pair in report["pairs"]:
        assert pair["identical"] and pair["psnr_db"] == "inf" and pair["ssim"] == 1.0
        assert pair["max_abs_diff"] == 0 and pair["diff_image"] is None
        assert pair["a"]["pixel_sha256"] == pair["b"]["pixel_sha256"]
        assert pair["a"]["png_sha256"] == pair["b"]["png_sha256"]
        assert (pair["width"], pair["height"], pair["steps"]) == (64, 64, 2)
        assert all((tmp_path / pair[side]["image"]).is_file() for side in "ab")


def test_model_per_side(tmp_path: Path) -> None:
    from qwen_image_fusion.eval.parity import build_parser, make_config

    model, other = embedded_copy(tmp_path / "a"), embedded_copy(tmp_path / "fp8")
    args = [
        "--model",
        str(model),
        "--model-b",
        str(other),
        "--a",
        "reference",
        "--b",
        "fp8-fused",
    ]
    config = make_config(build_parser().parse_args(args), args)
    assert config.models == {"a": str(model), "b": str(other)}
    assert make_config(build_parser().parse_args(args[2:]), args[2:]).models == {"a": None, "b": str(other)}


@pytest.mark.cpu_dtype
@pytest.mark.slow
def test_fp8_unfused_vs_fused_is_identical(prompts: Path, fp8_dir: Path, tmp_path: Path) -> None:
    """On an FP8 export of the embedded default (the worker's shared one, conftest.py), the fused producers
    reproduce the unfused bytes: over the built-in inpainting set, and over text prompts with the opt-in
    approximations on (a step cache and the VAE's fast decode, in one run: each side skips the same steps
    and decodes the same latents). Plain text-to-image fused == unfused through the CLI is docs/fp8.md's
    example (tests/test_docs_examples.py)."""
    # the built-in inpainting set (drawn start images and masks): fused and unfused give the same bytes
    inpaint = tmp_path / "inpaint"
    result = parity("--model", str(fp8_dir), "--prompts", "inpaint", "--a", "fp8-unfused",
                    "--b", "fp8-fused", "--size", "64x48", "--steps", "3", "--out", str(inpaint),
                    "--expect", "identical")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verdict: PASS (identical on all 6 pairs)" in result.stdout
    report = load(inpaint)
    assert all(p["mask"].endswith(".png") and p["init_image"] for p in report["pairs"])
    assert [report["variants"][slot]["workers"][0]["variant"] for slot in "ab"] == [
        "fp8-unfused",
        "fp8-fused",
    ]
    # two producers (attention and MLP input) for each of the image and text streams, in every block
    layers = json.loads((fp8_dir / "transformer" / "config.json").read_text(encoding="utf-8"))["num_layers"]
    paths = 2 * 2 * layers
    unfused, fused = (report["variants"][slot]["workers"][0]["fusion_summary"].splitlines() for slot in "ab")
    assert fused[0] == f"FP8 norm+quant fusion: {paths}/{paths} block paths"
    assert unfused[0] == f"FP8 norm+quant fusion: 0/{paths} block paths"
    assert unfused[1].startswith(f"  unfused ({paths}): fusion switched off (unfused path forced)")
    # with a step cache (opt-in, approximate) fused and unfused skip the same steps, and with the VAE's fast
    # decode (opt-in, approximate) they decode to the same bytes
    opted = tmp_path / "opted"
    options = "+fast-decode+cache:faster"
    result = parity("--model", str(fp8_dir), "--prompts", str(prompts), "--a", f"fp8-unfused{options}",
                    "--b", f"fp8-fused{options}", "--size", "64x64", "--steps", "8", "--out", str(opted),
                    "--expect", "identical")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verdict: PASS (identical on all 2 pairs)" in result.stdout
    pairs = load(opted)["pairs"]
    assert all(p["a"]["cache"] == p["b"]["cache"] and p["a"]["cache"]["preset"] == "faster" for p in pairs)
    ran = load(opted)["summary"]["ran"]
    assert (
        ran["a"] == ran["b"] and ran["a"]["cache_skipped"] is not None and "step cache a: " in result.stdout
    )
    assert ran["a"]["fast_decode"] == ran["a"]["images"] == ran["b"]["fast_decode"] > 0
    assert f"decode a: 2D form in {ran['a']['images']}/{ran['a']['images']} images" in result.stdout
