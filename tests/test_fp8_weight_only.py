"""FP8 weight-only linears (issue 24, `quantize --fp8-modulation`): the per-channel quantizer, the GEMV kernel
(under Triton's CPU interpreter) against its torch twin, checkpoints that store the modulation so and load
back with half its bytes, a broken one refused in one line, and LoRAs merged into such layers and back out
bit for bit."""

import json
import shutil

import pytest
import torch
from helpers import png_sha256
from lora_files import linear_shapes, random_factors, write_peft
from safetensors.torch import load_file, save_file

from bench.header_checkpoint import header_only_checkpoint
from qwen_image_fusion.kernels.fp8_gemv import _fp8_gemv_kernel, fp8_gemv_torch, fp8_gemv_triton
from qwen_image_fusion.kernels.quant import FP8_MAX
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.fp8_weight_only import (
    WEIGHT_ONLY_KEY,
    Fp8WeightOnlyLinear,
    quantize_per_channel,
)
from qwen_image_fusion.models.lora import lora_layers
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint
from qwen_image_fusion.ui.cli import main

REQUEST = dict(prompt="a red circle on the left", seed=2, num_inference_steps=2, width=32, height=32)
MODULATION = "transformer_blocks.1.img_mod.1"


def test_per_channel_quantization_maps_each_row_amax_to_448_and_is_idempotent():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=gen) * torch.logspace(-3, 2, 64)[:, None]
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))
    again, again_scale = quantize_per_channel(q.float() * scale[:, None])
    assert torch.equal(again.view(torch.uint8), q.view(torch.uint8)) and torch.equal(again_scale, scale)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_kernel_equals_its_twin_within_one_bf16_step(rows, bias):
    """Under the interpreter the kernel sums in its own order: within one bf16 step of the twin."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen).bfloat16()
    weight, scale = quantize_per_channel(torch.randn(96, 200, generator=gen))
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    y = fp8_gemv_triton(x, weight, scale, b)
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    twin = fp8_gemv_torch(x, weight, scale, b).float()
    # one bf16 step is at most 2^-7 of the value; near zero, the fp32 sums' own rounding
    assert bool(((y.float() - twin).abs() <= 2**-7 * twin.abs() + 1e-4).all())
    assert fp8_gemv_triton(x.float(), weight, scale, b) is None  # fp32 input: the twin serves it
    assert _fp8_gemv_kernel is not None


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """The embedded default quantized twice with the same calibration: BF16 and FP8 modulation."""
    root = tmp_path_factory.mktemp("fp8mod")
    plain = quantize_checkpoint(None, root / "plain", prompts=["a red fox"], steps=2, size=32, device="cpu")
    (root / "prompts.txt").write_text("a red fox\n")
    args = ["--out", str(root / "mod"), "--calib-prompts", str(root / "prompts.txt"), "--steps", "2"]
    assert main(["quantize", *args, "--size", "32", "--device", "cpu", "--fp8-modulation"]) == 0
    return plain, root / "mod"


@pytest.mark.cpu_dtype
def test_fp8_modulation_checkpoint_loads_with_half_the_modulation_bytes(fp8_dirs):
    plain, mod = fp8_dirs
    config = json.loads((mod / "transformer" / "config.json").read_text())["quantization_config"]
    assert config[WEIGHT_ONLY_KEY] == ["*.img_mod.1", "*.txt_mod.1"]
    assert not {"*.img_mod.1", "*.txt_mod.1"} & set(config["ignore"])
    pipe = load_pipeline(mod, device="cpu")
    layer = pipe.transformer.get_submodule(MODULATION)
    assert isinstance(layer, Fp8WeightOnlyLinear) and layer.weight_scale.shape == (layer.out_features,)
    bf16 = load_pipeline(plain, device="cpu").transformer.get_submodule(MODULATION)
    assert layer.weight.nbytes * 2 == bf16.weight.nbytes
    image = pipe.generate(**REQUEST)[0]
    assert image.size == (32, 32)
    spec, plain_spec = inspect_checkpoint(mod), inspect_checkpoint(plain)
    blocks = spec.family.memory_profile(spec, 2, 2).part("denoise").blocks
    plain_blocks = plain_spec.family.memory_profile(plain_spec, 2, 2).part("denoise").blocks
    assert plain_blocks[0] - blocks[0] == 2 * layer.weight.nbytes


def test_full_size_fp8_modulation_saves_6_8_gb(tmp_path):
    sizes = {}
    for name, modulation in (("plain", False), ("mod", True)):
        spec = inspect_checkpoint(header_only_checkpoint(tmp_path / name, fp8_modulation=modulation))
        sizes[name] = spec.family.memory_profile(spec, 2, 2).part("denoise").total
    assert sizes["plain"] - sizes["mod"] == 60 * 2 * (3072 * 18432 - 18432 * 4)  # weights halved, scales


@pytest.mark.cpu_dtype
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda state: state.__setitem__(f"{MODULATION}.weight_scale", torch.zeros(768)), "finite and > 0"),
        (lambda state: state.__setitem__(f"{MODULATION}.input_scale", torch.ones(())), "has an input_scale"),
        (lambda state: state.__setitem__(f"{MODULATION}.weight_scale", torch.ones(())), "one per output"),
    ],
)
def test_a_broken_weight_only_layer_is_refused_in_one_line(fp8_dirs, tmp_path, change, message):
    broken = tmp_path / "broken"
    shutil.copytree(fp8_dirs[1], broken)
    path = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(path)
    change(state)
    save_file(state, path)
    with pytest.raises(CheckpointError, match=message):
        load_pipeline(broken, device="cpu")


@pytest.mark.cpu_dtype
def test_a_lora_merges_into_weight_only_layers_and_back_out_bit_for_bit(fp8_dirs, tmp_path):
    pipe = load_pipeline(fp8_dirs[1], device="cpu")
    layer = pipe.transformer.get_submodule(MODULATION)
    before = (layer.weight.clone(), layer.weight_scale.clone())
    base = png_sha256(pipe.generate(**REQUEST)[0])
    shapes = linear_shapes(pipe.transformer)
    lora = write_peft(tmp_path / "mod.safetensors", random_factors(shapes, [MODULATION], 4, seed=3))
    pipe.load_lora(lora)
    branch = png_sha256(pipe.generate(**REQUEST)[0])
    pipe.set_lora_mode("merge")
    wrapper = lora_layers(pipe.transformer)[MODULATION]
    stats, scale = pipe.lora_merge.fp8[MODULATION], wrapper.base_layer.weight_scale
    # a row's amax / its new scale may round just past 448: at most one clipped per row, by rounding
    assert stats.clipped <= layer.out_features and stats.weights == layer.weight.numel()
    assert stats.max_abs_error <= 16 * float(scale.max())  # half of E4M3's step of 32 below 448
    assert not torch.equal(scale, before[1])
    merged = png_sha256(pipe.generate(**REQUEST)[0])
    assert base not in (branch, merged)
    pipe.unload_lora()
    assert torch.equal(layer.weight.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(layer.weight_scale, before[1])
    assert png_sha256(pipe.generate(**REQUEST)[0]) == base
