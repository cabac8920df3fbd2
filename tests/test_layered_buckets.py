"""`qwen-image layers` at diffusers' own 640 bucket: the command a user runs, against diffusers'
`QwenImageLayeredPipeline` unpatched (every other Layered oracle shrinks diffusers' bucket with
`small_layered_area`, so the size diffusers itself picks for a request is compared only here).

Tiny checkpoint, two steps, two layers, pixel for pixel: true CFG on with an RGBA input, off with an RGB one
(diffusers is given the image converted to its VAE's RGBA mode, as the model card's example does; the CLI
converts it itself). Each case is a CLI process and a diffusers run at about 640x640 pixels: slow.
"""

import subprocess
import sys
from pathlib import Path

import PIL.Image
import pytest
import torch
from edit_fixtures import drawn_image
from helpers import REPO, repo_env
from layered_fixtures import build_layered_checkpoint, diffusers_layered_pipeline

pytestmark = pytest.mark.slow

BUCKET = 640  # diffusers' default `resolution`: about BUCKET x BUCKET pixels at the image's aspect
LAYERS, STEPS, SEED = 2, 2, 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_layered_checkpoint(tmp_path_factory.mktemp("buckets") / "layered", seed=2, vae_base_dim=2)


@pytest.fixture(scope="module")
def diffusers_pipeline(checkpoint: Path):
    """diffusers' pipeline of the checkpoint, loaded once (each call sets its own scheduler and inputs)."""
    return diffusers_layered_pipeline(checkpoint)


def run_layers_command(
    image: Path, checkpoint: Path, negative: str | None, out: Path
) -> list[PIL.Image.Image]:
    """`qwen-image layers` in its own process with no size given (so the model picks the bucket), in FP32
    `reference` on the CPU; the PNGs it wrote, in layer order."""
    command = [sys.executable, "-m", "qwen_image_fusion.ui.cli", "layers", str(image), "--prompt",
               "a poster", "--layers", str(LAYERS), "--steps", str(STEPS), "--seed", str(SEED), "--model",
               str(checkpoint), "--device", "cpu", "--dtype", "fp32", "--variant", "reference",
               "-o", str(out)]  # fmt: skip
    if negative is not None:
        command += ["--negative-prompt", negative]
    result = subprocess.run(command, capture_output=True, text=True, env=repo_env(), cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    paths = [out / f"layer-{j}.png" for j in range(LAYERS)]
    assert sorted(out.iterdir()) == paths
    return [PIL.Image.open(path) for path in paths]


@pytest.mark.parametrize(("mode", "negative"), [("RGBA", "blurry"), ("RGB", None)])
def test_layers_command_equals_diffusers_at_its_own_640_bucket(
    checkpoint, diffusers_pipeline, tmp_path, mode, negative
):
    picture = drawn_image(200, 150, 3, mode)  # 4:3, so the bucket's width and height differ
    path = tmp_path / "poster.png"
    picture.save(path)
    ours = run_layers_command(path, checkpoint, negative, tmp_path / "layers")
    theirs = diffusers_pipeline(
        image=picture.convert("RGBA"),
        prompt="a poster",
        negative_prompt=negative,
        layers=LAYERS,
        num_inference_steps=STEPS,
        resolution=BUCKET,
        generator=torch.Generator().manual_seed(SEED),
    ).images[0]
    assert len(theirs) == len(ours) == LAYERS
    width, height = theirs[0].size
    assert width != height and abs(width * height / BUCKET**2 - 1) < 0.1  # the real bucket, not a small one
    for mine, expected in zip(ours, theirs, strict=True):
        assert (mine.mode, mine.size) == (expected.mode, expected.size) == ("RGBA", (width, height))
        assert mine.tobytes() == expected.tobytes()
