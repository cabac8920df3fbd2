"""Qwen-Image 2.1 in FP8 through the whole pipeline on CPU: `qwen-image quantize` writes a ModelOpt FP8 2.1
checkpoint with the family's recipe (Q/K/V and gate_layer/proj sharing one input scale each, `img_mlp.out`
kept in BF16 unless asked), and fp8-fused gives the PNG bytes of fp8-unfused, with condition images, true CFG
and the KV cache on or off, in the pipeline and in `qwen_image_fusion.eval.parity`."""

import json
import subprocess
import sys

import pytest
from edit_fixtures import drawn_image
from helpers import REPO, png_sha256
from qi21_checkpoints import RESOLUTION, build_qi21_checkpoint
from safetensors.torch import load_file

from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.cli import main

LAYERS = 2  # tests/qi21_checkpoints.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny BF16 checkpoint quantized twice by the CLI: default BF16 fallback, and every block linear."""
    root = tmp_path_factory.mktemp("qi21fp8")
    bf16 = build_qi21_checkpoint(root / "bf16")
    prompts = root / "prompts.txt"
    prompts.write_text("a red fox in the snow\n一只熊猫在竹林里\n")
    common = ["--model", str(bf16), "--steps", "2", "--size", "64", "--calib-prompts", str(prompts)]
    assert main(["quantize", *common, "--out", str(root / "fp8"), "--device", "cpu"]) == 0
    keep = ",".join(QUANTIZATION.all_blocks_fp8)
    assert main(["quantize", *common, "--out", str(root / "fp8-all"), "--keep-bf16", keep]) == 0
    return {"default": root / "fp8", "all": root / "fp8-all", "prompts": prompts}


def block_tensors(directory):
    return load_file(directory / "transformer" / "diffusion_pytorch_model.safetensors")


@pytest.mark.cpu_dtype
@pytest.mark.parametrize("kind", ["default", "all"])
def test_quantize_writes_a_modelopt_fp8_checkpoint_with_shared_scales(checkpoints, kind):
    directory = checkpoints[kind]
    spec = inspect_checkpoint(directory)
    assert spec.fp8 and spec.family.name == "qwen-image-2.1"
    config = json.loads((directory / "transformer" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    tensors = block_tensors(directory)
    for i in range(LAYERS):
        block = f"transformer_blocks.{i}."
        for group in (("attn.to_q", "attn.to_k", "attn.to_v"), ("img_mlp.gate_layer", "img_mlp.proj")):
            scales = [tensors[f"{block}{name}.input_scale"] for name in group]
            assert all(s.equal(scales[0]) for s in scales) and float(scales[0]) > 0, group
        assert (f"{block}img_mlp.out.input_scale" in tensors) == (kind == "all")
    assert "modulation.1.input_scale" not in tensors


@pytest.mark.cpu_dtype
@pytest.mark.parametrize(
    ("kind", "swiglu", "caches"), [("default", 0, (True, False)), ("all", LAYERS, (True,))]
)
def test_fp8_fused_equals_unfused_png_for_png(checkpoints, kind, swiglu, caches):
    pipe = load_pipeline(checkpoints[kind], device="cpu")
    pipe.model.resolution = RESOLUTION
    assert pipe.variant == "fp8-fused"
    assert pipe.fusion_summary().splitlines()[:2] == [
        f"FP8 norm+quant fusion: {2 * LAYERS}/{2 * LAYERS} block paths",
        f"FP8 SwiGLU+quant fusion: {swiglu}/{LAYERS} MLP paths",
    ]
    image = drawn_image(96, 64, seed=3, mode="RGBA")
    requests = [
        dict(prompt=["a red fox", "a much longer prompt about a fox"], width=64, height=32),
        dict(prompt="make it snow", image=image, negative_prompt="blurry", true_cfg_scale=3.0),
    ]
    results = {}
    for variant in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(variant)
        for cache in caches:
            pipe.model.use_kv_cache = cache
            for i, request in enumerate(requests):
                images = pipe.generate(num_inference_steps=3, seed=4, **request)
                results[variant, cache, i] = [png_sha256(im) for im in images]
    for key, hashes in results.items():
        if key[0] == "fp8-fused":
            assert hashes == results["fp8-unfused", *key[1:]], key


@pytest.mark.cpu_dtype
def test_eval_parity_fused_vs_unfused_is_identical(checkpoints, tmp_path):
    command = [sys.executable, "-m", "qwen_image_fusion.eval.parity", "--model", str(checkpoints["all"]),
               "--a", "fp8-unfused", "--b", "fp8-fused", "--prompts", str(checkpoints["prompts"]),
               "--seeds", "0", "--size", "64x64", "--steps", "2", "--out", str(tmp_path),
               "--expect", "identical"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["pairs"] == 2 and report["summary"]["identical"] == 2
