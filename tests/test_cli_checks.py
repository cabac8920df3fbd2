"""Everything the arguments, the checkpoint's configs and the files can tell is checked before a model loads
(and, where no library is needed, before torch is even imported): each bad call is one `error:` line."""

import json
import subprocess
import sys

import pytest
from helpers import REPO

from qwen_image_fusion.ui.cli import main

PROBE = """
import sys
from qwen_image_fusion.ui.cli import main
status = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules)
print(f"status={status} heavy={','.join(heavy)}")
"""


def run_probe(*args: str) -> tuple[int, str, str]:
    """A fresh interpreter running the CLI: its exit status, the heavy libraries it imported, stderr."""
    command = [sys.executable, "-c", PROBE, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, cwd=REPO)
    status, heavy = result.stdout.strip().splitlines()[-1].split()
    return int(status.split("=")[1]), heavy.split("=")[1], result.stderr.strip()


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A checkpoint whose transformer config declares ModelOpt FP8 (configs only: nothing loads it)."""
    from qwen_image_fusion.models.embedded import DEFAULT_MODEL_DIR

    directory = tmp_path_factory.mktemp("fp8cfg") / "model"
    directory.mkdir()
    for name in ("model_index.json",):
        (directory / name).write_text((DEFAULT_MODEL_DIR / name).read_text())
    for part in ("transformer", "text_encoder", "vae", "scheduler"):
        (directory / part).mkdir()
        for config in (DEFAULT_MODEL_DIR / part).glob("*.json"):
            (directory / part / config.name).write_text(config.read_text())
    config_path = directory / "transformer" / "config.json"
    quant = {"quant_method": "modelopt", "quant_algo": "FP8"}
    config = json.loads(config_path.read_text()) | {"quantization_config": quant}
    config_path.write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "fox", "--variant", "bogus"], "unknown variant 'bogus'"),
        (["generate", "fox", "--variant", "fp8-fused"], "variant 'fp8-fused' needs FP8 weights"),
        (["info", "--variant", "fp8-unfused"], "variant 'fp8-unfused' needs FP8 weights"),
        (
            ["generate", "fox", "-o", "/nonexistent_dir/x.png"],
            "output folder /nonexistent_dir does not exist",
        ),
        (["quantize", "--out", "{tmp}/q", "--size", "65"], "width 65 must be a multiple of 16"),
        (["quantize", "--out", "{tmp}/q", "--calib-prompts", "{tmp}/nofile.txt"], "prompt file not found"),
        (["quantize", "--out", str(REPO)], "exists and is not an empty directory"),
        (["quantize", "--out", "{tmp}/q", "--model", "{fp8}"], "is already an FP8 checkpoint"),
        (["generate", "fox", "--lora", "{tmp}/a.safetensors:abc"], "LoRA scale 'abc' in"),
    ],
)
def test_refused_without_importing_torch(args, message, tmp_path, fp8_checkpoint):
    (tmp_path / "a.safetensors").write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)).replace("{fp8}", str(fp8_checkpoint)) for a in args]
    status, heavy, err = run_probe(*args)
    assert status == 2 and heavy == "", (status, heavy)
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_dtype_names_are_checked_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "fox", "--dtype", "fp16"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_cuda_without_cuda_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(
        "qwen_image_fusion.ui.commands.load", lambda *_: pytest.fail("the model loaded before the check")
    )
    assert main(["generate", "fox", "--device", "cuda", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: device 'cuda' was requested but CUDA is not available on this machine"
