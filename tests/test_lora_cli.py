"""LoRA and presets as a user meets them: `generate --lora FILE[:SCALE] --preset`, one-line errors before the
model loads where possible, `ui --lora-dir`, and the demo's preset and LoRA controls."""

from types import SimpleNamespace

import pytest
import torch
from gradio_client import Client
from lora_files import block_modules, linear_shapes, random_factors, write_comfy, write_lightning
from PIL import Image
from test_ui_app import FakePipe

import qwen_image_fusion.pipelines as pipelines
from qwen_image_fusion.models.vae_decode import DecodeReport
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.presets import PRESETS, parse_lora_spec
from qwen_image_fusion.pipelines.run_info import CacheReport, RunInfo
from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.cli import build_parser, main
from qwen_image_fusion.ui.lora_controls import NO_CACHE, NO_PRESET, lora_details, preset_settings, run_kwargs


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("loras")
    pipe = load_pipeline(device="cpu")
    shapes, layers = linear_shapes(pipe.transformer), pipe.transformer.config.num_layers
    write_lightning(
        directory / "Qwen-Image-Lightning-4steps-V1.0.safetensors",
        random_factors(shapes, block_modules(layers), 8, seed=1, dtype=torch.bfloat16),
        1.0,
    )
    write_comfy(
        directory / "style.safetensors", random_factors(shapes, block_modules(layers)[:6], 4, seed=2), 4
    )
    return directory


@pytest.mark.cpu_dtype
def test_generate_with_stacked_loras_and_a_preset(lora_dir, tmp_path, capsys):
    out = tmp_path / "fast.png"
    lightning = lora_dir / "Qwen-Image-Lightning-4steps-V1.0.safetensors"
    args = ["generate", "a red fox", "-o", str(out), "--width", "48", "--height", "32", "--seed", "3"]
    args += [
        "--lora",
        str(lightning),
        "--lora",
        f"{lora_dir / 'style.safetensors'}:0.6",
        "--preset",
        "lightning-4",
    ]
    assert main([*args, "--lora-mode", "merge"]) == 0
    stdout = capsys.readouterr().out
    linears = 14 * load_pipeline(device="cpu").transformer.config.num_layers  # every block linear
    assert (
        f"LoRA (merge): Qwen-Image-Lightning-4steps-V1.0 x1 on {linears} layers, style x0.6 on 6 layers"
        in stdout
    )
    assert f"preset: {PRESETS['lightning-4'].describe()}" in stdout
    assert "ms/step x 4)" in stdout  # 4 steps from the preset
    assert f"LoRA merged into {linears} BF16 linears" in stdout
    assert Image.open(out).size == (48, 32)


def test_presets_are_visible_in_help():
    text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for preset in PRESETS.values():
        assert preset.name in text
    assert "log 3" in text and "FILE[:SCALE]" in text


def test_lora_spec_parsing(lora_dir):
    style = lora_dir / "style.safetensors"
    assert parse_lora_spec(str(style)).scale == 1.0
    assert parse_lora_spec(f"{style}:-0.25").scale == -0.25
    assert parse_lora_spec(f"{style}:-0.25").path == style


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ("/nowhere/style.safetensors", "LoRA file /nowhere/style.safetensors does not exist"),
        ("{dir}/style.safetensors:nan", "LoRA scale nan for {dir}/style.safetensors:nan must be a finite"),
        ("{dir}/style.safetensors:x", "LoRA scale 'x' in '{dir}/style.safetensors:x' is not a number"),
        ("{tmp}/notes.safetensors", "LoRA file {tmp}/notes.safetensors is not a safetensors file"),
    ],
)
def test_bad_lora_arguments_fail_in_one_line_before_the_model_loads(
    lora_dir, tmp_path, monkeypatch, capsys, lora, message
):
    (tmp_path / "notes.safetensors").write_text("notes")
    monkeypatch.setattr(pipelines, "load_pipeline", None, raising=False)  # loading would fail otherwise
    lora, message = (
        text.replace("{dir}", str(lora_dir)).replace("{tmp}", str(tmp_path)) for text in (lora, message)
    )
    for command in (["generate", "a fox"], ["quantize", "--out", str(tmp_path / "out")]):
        assert main([*command, "--lora", lora]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {message}")


@pytest.mark.parametrize(
    ("module", "shape", "message"),
    [
        ("transformer_blocks.7.attn.to_q", (2, 64), "matches no linear layer of the transformer"),
        ("transformer_blocks.0.attn.to_q", (2, 96), "do not fit the layer's"),
    ],
)
def test_lora_that_does_not_fit_the_model_is_one_line_before_loading(
    tmp_path, monkeypatch, capsys, module, shape, message
):
    """Keys and shapes are checked against the transformer built from its config on the meta device."""
    monkeypatch.setattr(
        "qwen_image_fusion.ui.commands.load", lambda *_: pytest.fail("the model loaded before the LoRA check")
    )
    factors = {module: (torch.ones(*shape), torch.ones(shape[1], shape[0]))}
    path = write_lightning(tmp_path / "other-model.safetensors", factors, 2.0)
    assert main(["generate", "a fox", "-o", str(tmp_path / "x.png"), "--lora", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: LoRA file {path}: {module}") and message in err[0]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing", "LoRA directory {d}/missing does not exist"),
        (lambda d: d, "LoRA directory {d} holds no *.safetensors files"),
    ],
)
def test_ui_lora_dir_is_checked_before_the_model_loads(tmp_path, monkeypatch, capsys, make, message):
    monkeypatch.setattr(pipelines, "load_pipeline", None, raising=False)
    assert main(["ui", "--lora-dir", str(make(tmp_path))]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message.replace('{d}', str(tmp_path))}"


def test_ui_controls_make_generate_arguments():
    assert run_kwargs([], NO_PRESET, NO_CACHE, False, []) == {"preset": None, "cache": None}
    assert run_kwargs(["a", "b"], "lightning-8", "fast", True, [0.5, 0]) == {
        "preset": "lightning-8",
        "cache": "fast",
        "fast_decode": True,
        "lora_scales": {"a": 0.5, "b": 0.0},
    }
    assert preset_settings("lightning-4", 30, 4.0) == (4, 1.0)
    assert preset_settings(NO_PRESET, 30, 4.0) == (30, 4.0)
    run = SimpleNamespace(preset="lightning-4", loras="LoRA (branch): fast x1 on 28 layers")
    assert lora_details(run) == "\n**Preset:** lightning-4  \n**LoRA (branch): fast x1 on 28 layers**  "
    assert lora_details(SimpleNamespace(preset="", loras="")) == ""
    cache = CacheReport("fast", 8, {"positive": (3,)})
    run = RunInfo(0, 64, 64, 8, "reference", "", cache=cache, decode=DecodeReport(fast=False, tiled=False))
    assert (
        lora_details(run) == "\n**Step cache:** fast: middle blocks skipped in 3 of 8 steps (approximate)  "
    )
    run = RunInfo(0, 64, 64, 8, "reference", "", decode=DecodeReport(fast=True, tiled=False))
    assert lora_details(run) == "\n**Decode:** the VAE's 2D form (approximate), whole  "


def test_ui_passes_the_lora_scales_and_preset_to_generate():
    pipe = FakePipe()
    pipe.loras = {"fast": SimpleNamespace(scale=0.5), "style": SimpleNamespace(scale=0.5)}
    demo = build_app(pipe)
    _, url, _ = demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        client = Client(url, verbose=False, analytics_enabled=False)
        client.predict(
            "a fox", aspect="custom", width=32, height=32, num_inference_steps=2, api_name="/generate"
        )
    finally:
        demo.close()
    call = pipe.calls[-1]
    assert call["preset"] is None and call["lora_scales"] == {"fast": 0.5, "style": 0.5}
    assert pipe.scales_set == [{"fast": 0.5, "style": 0.5}]  # set on the model before it ran
