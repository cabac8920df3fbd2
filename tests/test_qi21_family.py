"""The Qwen-Image 2.1 family around the model, as a user meets it: its checkpoints recognised and checked
without torch (a misfit is one line naming it), `qwen-image generate --model <2.1 dir> --image FILE` and
`info`, the web demo, and what is not built for 2.1 (Ulysses, Lightning presets) refused in one line."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
from edit_fixtures import drawn_image
from helpers import REPO
from qi21_checkpoints import RESOLUTION, TURBO_SIGMAS, build_qi21_checkpoint

from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.qwen_image21 import model
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.cli import main
from qwen_image_fusion.ui.generation import aspect_ratios, job_from_inputs
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.runner import Runner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_qi21_checkpoint(tmp_path_factory.mktemp("qi21") / "ckpt")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "qwen_image_fusion.ui.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, cwd=REPO)


def one_line_error(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err)
    return err[-1]


def test_inspect_reads_a_2_1_checkpoint_without_torch(model_dir):
    code = (
        "import sys; from qwen_image_fusion.models.families import inspect_checkpoint\n"
        f"spec = inspect_checkpoint({str(model_dir)!r})\n"
        "print(spec.family.name, spec.size_multiple, spec.max_images, spec.sequence_parallel, spec.fp8,"
        " spec.attention_heads, spec.defaults.num_inference_steps, spec.defaults.true_cfg_scale,"
        " spec.defaults.width, 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.stdout.split() == [
        "qwen-image-2.1",
        "32",
        "4",
        "False",
        "False",
        "2",
        "40",
        "1.0",
        "1024",
        "False",
    ]


def edited(model_dir, tmp_path, path: str, edit) -> str:
    """A copy of the checkpoint (weights linked, configs copied) with `edit(dict)` applied to one JSON file,
    or `edit` None: that file or folder removed."""
    copy = tmp_path / "edited"
    shutil.copytree(model_dir, copy, copy_function=os.symlink)
    target = copy / path
    if edit is None:
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        return str(copy)
    data = json.loads(target.read_text())
    target.unlink()
    edit(data)
    target.write_text(json.dumps(data))
    return str(copy)


@pytest.mark.parametrize(
    ("path", "edit", "message"),
    [
        (
            "transformer/config.json",
            lambda c: c.update(patch_size=2),
            "packs latents unpatched (patch_size 1)",
        ),
        (
            "transformer/config.json",
            lambda c: c.update(in_channels=8),
            "z_dim 16 differs from the transformer's",
        ),
        ("vae/config.json", lambda c: c.update(temperal_downsample=[False, True, True]), "is not a 16x VAE"),
        (
            "vae/config.json",
            lambda c: c.update(latents_std=[1.0]),
            "latents_std must be a list of z_dim = 16",
        ),
        ("vae/config.json", lambda c: c.update(in_channels=3), "the 2.1 pipeline encodes RGBA images (4)"),
        (
            "text_encoder/config.json",
            lambda c: c.update(model_type="qwen2_5_vl"),
            "2.1 encodes with 'qwen3_vl'",
        ),
        (
            "text_encoder/config.json",
            lambda c: c["text_config"].update(hidden_size=32),
            "hidden_size 32 differs from the transformer's context_in_dim 64",
        ),
        (
            "processor/preprocessor_config.json",
            lambda c: c.update(patch_size=14),
            "patch_size 14 differs from",
        ),
        ("processor/chat_template.jinja", None, "has no chat template"),
        ("processor", None, "missing processor/"),
        (
            "model_index.json",
            lambda c: c.update(sample_sigmas=[1.0, 0.0]),
            "sample_sigmas must be a non-empty",
        ),
        (
            "model_index.json",
            lambda c: c.update(_generation_defaults={"width": 48}),
            "is not a multiple of 32",
        ),
    ],
)
def test_misfit_checkpoints_are_refused_in_one_line_before_loading(
    model_dir, tmp_path, capsys, path, edit, message
):
    broken = edited(model_dir, tmp_path, path, edit)
    line = one_line_error(["info", "--model", broken], capsys)
    assert line.startswith("error: ") and message in line, line


@pytest.mark.cpu_dtype
def test_generate_from_the_command_line(model_dir, tmp_path, capsys):
    """As a user runs it; 2.1 decodes RGBA, and a JPEG output keeps the RGB channels with a warning."""
    out = tmp_path / "fox.png"
    size = ["--width", "64", "--height", "32", "--steps", "2", "--seed", "3"]
    result = run_cli("generate", "a red fox", "--model", str(model_dir), "-o", str(out), *size)
    assert result.returncode == 0, result.stderr[-3000:]
    image = PIL.Image.open(out)
    assert image.size == (64, 32) and image.mode == "RGBA" and np.asarray(image).std() > 0
    assert "seed 3" in result.stdout and "ms/step x 2" in result.stdout
    jpeg = tmp_path / "fox.jpg"
    assert main(["generate", "a red fox", "--model", str(model_dir), "-o", str(jpeg), *size]) == 0
    assert PIL.Image.open(jpeg).mode == "RGB" and "stores no alpha" in capsys.readouterr().err


@pytest.mark.cpu_dtype
def test_generate_with_condition_images_takes_the_last_ones_aspect(model_dir, tmp_path, monkeypatch, capsys):
    """`--image` twice, in order; without --width/--height the output has the last image's aspect at the
    condition area (64x64 here instead of 1024x1024, so it runs in seconds)."""
    monkeypatch.setattr(model, "OUTPUT_RESOLUTION", RESOLUTION)
    paths = [tmp_path / "wide.png", tmp_path / "tall.png"]
    drawn_image(160, 64, seed=1, mode="RGBA").save(paths[0])
    drawn_image(48, 112, seed=2).save(paths[1])
    out = tmp_path / "out.png"
    images = [arg for path in paths for arg in ("--image", str(path))]
    args = ["generate", "make it snow", "--model", str(model_dir), *images, "-o", str(out), "--steps", "2"]
    assert main(args) == 0
    assert PIL.Image.open(out).size == (32, 96)  # 48x112 at 64x64 pixels, sides multiples of 32
    assert "wrote" in capsys.readouterr().out


@pytest.mark.cpu_dtype
def test_a_processor_that_resizes_condition_images_is_refused_in_one_line(model_dir, tmp_path, capsys):
    """Vision tokens and latent tokens of a condition image must cover the same pixels: a processor whose
    pixel ceiling shrinks the images is named instead of failing inside the transformer."""
    ceiling = lambda config: config["size"].update(longest_edge=64 * 64)  # noqa: E731
    small = edited(model_dir, tmp_path, "processor/preprocessor_config.json", ceiling)
    image = tmp_path / "in.png"
    drawn_image(64, 64, seed=0).save(image)
    args = ["generate", "a fox", "--model", small, "--image", str(image), "--width", "32", "--height", "32"]
    line = one_line_error([*args, "--steps", "2", "-o", str(tmp_path / "out.png")], capsys)
    # a 64x64 image at the default 1024x1024 condition area: (1024 / 32)^2 vision tokens expected
    assert "vision tokens, not 1024: its pixel limits" in line and "'longest_edge': 4096" in line, line


@pytest.mark.cpu_dtype
def test_info_describes_the_family(model_dir, capsys):
    assert main(["info", "--model", str(model_dir), "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    for expected in (
        "(qwen-image-2.1 family)",
        "2 single-stream layers, width 64, 2 heads x 32, SwiGLU 192",
        "text encoder: Qwen3VLForConditionalGeneration",
        "processor: Qwen3VLProcessor (Qwen2VLImageProcessorPil)",
        "image sizes: multiples of 32",
        "input images: optional, at most 4",
        "defaults: 1024x1024, 40 steps, true CFG off unless a negative prompt is given",
        "prefix KV cache: on",
        "--gpus 2 with true CFG on: CFG-2 x Ulysses-1 on 2 ranks",
        "--gpus 2 with true CFG off: none (CFG-1 x Ulysses-2 on 2 ranks: Ulysses sequence parallelism is not "
        "built for the qwen-image-2.1 family",
    ):
        assert expected in out, expected


@pytest.mark.cpu_dtype
def test_turbo_info_shows_its_grid(tmp_path, capsys):
    turbo = build_qi21_checkpoint(tmp_path / "turbo", sample_sigmas=TURBO_SIGMAS)
    assert inspect_checkpoint(turbo).defaults.num_inference_steps == len(TURBO_SIGMAS)
    assert main(["info", "--model", str(turbo)]) == 0
    assert "Turbo grid of 4 sigmas (1, 0.9, 0.7, 0.4)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpus", "2"], "Ulysses sequence parallelism is not built for the qwen-image-2.1 family"),
        (
            ["--preset", "lightning-8"],
            "preset lightning-8 is made for qwen-image and qwen-image-controlnet checkpoints",
        ),
        (["--image", "IMAGE"] * 5, "5 input images, but"),
        (["--image", "/nonexistent.png"], "input image /nonexistent.png does not exist"),
        (["--width", "48"], "width 48 must be a multiple of 32"),
    ],
)
def test_what_2_1_does_not_take_is_refused_before_loading(model_dir, tmp_path, capsys, extra, message):
    image = tmp_path / "in.png"
    drawn_image(32, 32, seed=0).save(image)
    args = [str(image) if a == "IMAGE" else a for a in extra]
    line = one_line_error(["generate", "a fox", "--model", str(model_dir), *args], capsys)
    assert message in line, line


def test_a_text_only_model_refuses_input_images(tmp_path, capsys):
    image = tmp_path / "in.png"
    drawn_image(32, 32, seed=0).save(image)
    line = one_line_error(["generate", "a fox", "--image", str(image)], capsys)
    assert "generates from text only and takes no input images" in line


@pytest.mark.cpu_dtype
def test_web_demo_serves_2_1(model_dir):
    """The demo's pieces around a 2.1 pipeline: aspect presets on its 32-pixel grid, a request run by the
    Runner, and the app built."""
    from qwen_image_fusion.ui.app import build_app

    pipe = load_pipeline(model_dir, device="cpu")
    presets = aspect_ratios(pipe.size_multiple)
    assert all(w % 32 == 0 and h % 32 == 0 for w, h in presets.values()) and presets["1:1"] == (1312, 1312)
    values = dict(prompt="a red fox", negative_prompt="", aspect="custom", width=64, height=32,
                  num_inference_steps=2, true_cfg_scale=1.0, seed=5, randomize_seed=False, num_images=1,
                  variant=pipe.variant)  # fmt: skip
    job = job_from_inputs(None, values, pipe)
    runner = Runner(pipe, Limits.for_device("cpu", time_limit_s=600))
    images, run = runner.run(job, lambda i, n: None)
    runner.close()
    assert images[0].size == (64, 32) and run.seed == 5
    build_app(pipe)
