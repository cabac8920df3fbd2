"""NVFP4 checkpoints end to end on the CPU (issue 52): `qwen-image quantize --format nvfp4` writes the
embedded default as a ModelOpt NVFP4 export (the first two and last two blocks and everything outside the
blocks kept BF16), it loads into the weight path and `qwen-image generate` draws from it, the memory plan
counts what loading holds, and a broken layer is refused in one line naming its tensor."""

import json
import shutil

import numpy as np
import PIL.Image
import pytest
import torch
from helpers import step_without_host_sync
from lora_files import linear_shapes, random_factors, write_peft
from safetensors.torch import load_file, save_file

from bench.header_checkpoint import header_only_checkpoint
from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import CheckpointError, InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.loading import load_transformer
from qwen_image_fusion.models.nvfp4 import Nvfp4Linear, quantize_nvfp4_weight
from qwen_image_fusion.models.qwen_image.components import build_transformer
from qwen_image_fusion.models.qwen_image.model import OUTSIDE_BLOCKS
from qwen_image_fusion.models.streaming import moving_tensors
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.memory_plan import checkpoint_plan
from qwen_image_fusion.ui.cli import main

CPU = torch.device("cpu")
REQUEST = dict(prompt="a red circle on the left", seed=4, num_inference_steps=3, width=64, height=64)
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    """The embedded default quantized to NVFP4 by the CLI (two prompts, 2 steps at 32x32)."""
    root = tmp_path_factory.mktemp("nvfp4")
    (root / "prompts.txt").write_text("a red fox\n一只熊猫\n")
    args = ["--out", str(root / "model"), "--calib-prompts", str(root / "prompts.txt"), "--steps", "2"]
    assert main(["quantize", *args, "--size", "32", "--device", "cpu", "--format", "nvfp4"]) == 0
    return root / "model"


@pytest.fixture(scope="module")
def source():
    """The embedded default's BF16 transformer weights, as quantize read them."""
    return load_pipeline(variant="contract", device="cpu", dtype="bf16").transformer.state_dict()


def edge_blocks(layers: int) -> list[int]:
    return [0, 1, layers - 2, layers - 1]


def test_quantize_writes_a_modelopt_nvfp4_export(nvfp4_dir, source):
    config = json.loads((nvfp4_dir / "transformer" / "config.json").read_text())
    layers = config["num_layers"]
    quant = config["quantization_config"]
    kept = [*OUTSIDE_BLOCKS, *(f"transformer_blocks.{i}.*" for i in edge_blocks(layers))]
    assert (quant["quant_method"], quant["quant_algo"], quant["group_size"]) == ("modelopt", "NVFP4", 16)
    assert quant["ignore"] == kept
    nested = json.loads((nvfp4_dir / "transformer" / "hf_quant_config.json").read_text())["quantization"]
    assert nested == {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": kept}
    state = load_file(nvfp4_dir / "transformer" / WEIGHTS)
    quantized = {k.removesuffix(".weight_scale_2") for k in state if k.endswith(".weight_scale_2")}
    middle = {f"transformer_blocks.{i}." for i in range(layers) if i not in edge_blocks(layers)}
    block_linears = {
        k.removesuffix(".weight") for k, v in source.items() if k.endswith(".weight") and v.dim() == 2
    }
    assert quantized == {n for n in block_linears if n.startswith(tuple(middle))}
    for name in quantized:  # the bytes of each layer are the quantizer's of its BF16 weight
        packed, block_scale, weight_scale_2 = quantize_nvfp4_weight(source[f"{name}.weight"])
        assert torch.equal(state[f"{name}.weight"], packed), name
        assert torch.equal(state[f"{name}.weight_scale"].view(torch.uint8), block_scale.view(torch.uint8))
        assert torch.equal(state[f"{name}.weight_scale_2"], weight_scale_2)
        assert state[f"{name}.input_scale"].dtype == torch.float32 and float(state[f"{name}.input_scale"]) > 0
    block = f"transformer_blocks.{layers // 2}.attn."
    scales = [state[f"{block}{n}.input_scale"] for n in ("to_q", "to_k", "to_v")]
    assert all(torch.equal(s, scales[0]) for s in scales), "Q/K/V read one activation: one input scale"
    assert state["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16


@pytest.mark.cpu_dtype
def test_an_nvfp4_checkpoint_loads_into_the_weight_path(nvfp4_dir):
    spec = inspect_checkpoint(nvfp4_dir)
    assert spec.weights is WeightFormat.NVFP4 and not spec.fp8
    pipe = load_pipeline(nvfp4_dir, device="cpu")
    layers = pipe.transformer.config.num_layers
    per_block = sum(isinstance(m, torch.nn.Linear) for m in pipe.transformer.transformer_blocks[0].modules())
    nvfp4 = [n for n, m in pipe.transformer.named_modules() if isinstance(m, Nvfp4Linear)]
    assert len(nvfp4) == per_block * (layers - 4)
    assert pipe.variant == "nvfp4"  # the CPU also runs W4A4, through its twins
    assert pipe.available_variants() == ["nvfp4", "nvfp4-w4a4-unfused", "nvfp4-w4a4-fused"]
    assert pipe.fusion_summary().startswith("NVFP4 weight path")
    weights = sum(
        m.in_features * m.out_features for m in pipe.transformer.modules() if isinstance(m, Nvfp4Linear)
    )
    assert f"e2m1 {weights / 1e6:.2f}M" in pipe.model.describe()[0]  # `info` counts the values, not the bytes
    with pytest.raises(
        InputError, match="variant 'fp8-fused' needs FP8 weights, and this checkpoint has Mod"
    ):
        pipe.set_variant("fp8-fused")
    step_without_host_sync(pipe.transformer, (1, 4, 4))


def psnr(a, b) -> float:
    a, b = (np.asarray(im, dtype=np.float64) for im in (a, b))
    return float(10 * np.log10(255.0**2 / np.mean((a - b) ** 2)))


@pytest.mark.cpu_dtype
def test_generate_draws_from_an_nvfp4_checkpoint_close_to_its_bf16_source(nvfp4_dir, tmp_path, capsys):
    out = tmp_path / "fox.png"
    flags = ["--steps", "3", "--width", "64", "--height", "64", "--seed", "4", "--device", "cpu"]
    assert main(["generate", REQUEST["prompt"], "--model", str(nvfp4_dir), "-o", str(out), *flags]) == 0
    assert "NVFP4 weight path" in capsys.readouterr().out
    drawn = PIL.Image.open(out).convert("RGB")
    source = load_pipeline(variant="contract", device="cpu", dtype="bf16")
    same_seed = source.generate(**REQUEST)[0]
    other_seed = source.generate(**(REQUEST | {"seed": 5}))[0]
    assert drawn.size == (64, 64)
    # 4-bit weights move the image, but it stays the source's picture: nearer than another seed's
    assert psnr(drawn, same_seed) > psnr(drawn, other_seed) + 6


def test_header_sizes_are_the_bytes_the_loaded_nvfp4_transformer_holds(nvfp4_dir):
    spec = inspect_checkpoint(nvfp4_dir)
    part = spec.family.memory_profile(spec, 2, 2).part("denoise")
    model = load_transformer(nvfp4_dir / "transformer", build_transformer, torch.bfloat16, CPU)
    blocks = list(model.transformer_blocks)
    stored = model.state_dict().values()
    assert part.small == sum(t.numel() * t.element_size() for t in stored if t.dim() < 2)
    assert part.blocks == tuple(sum(m.nbytes for m in moving_tensors(b)) for b in blocks)
    assert part.fixed == sum(m.nbytes for m in moving_tensors(model, skip=blocks))
    assert part.blocks[2] < part.blocks[0] / 3  # a middle block: 4.5 bits a weight against 16


def test_full_size_nvfp4_transformer_is_13_5_gb_and_fits_16_gib_without_streaming(tmp_path):
    """Issue 52's sizes: 56 middle blocks at 4.5 bits a weight (E2M1 + an E4M3 scale per 16), 4 in BF16."""
    spec = inspect_checkpoint(header_only_checkpoint(tmp_path / "nvfp4", nvfp4=True))
    part = spec.family.memory_profile(spec, 2, 2).part("denoise")
    per_block = 2 * 3072 * 18432 + 8 * 3072 * 3072 + 4 * 3072 * 12288  # weights of one block's linears
    assert part.blocks[2] - part.blocks[0] == per_block * (9 / 16 - 2)  # 0.5 + 1/16 bytes against 2
    assert 13.4e9 < part.total < 13.6e9
    assert part.blocks[0] == pytest.approx(0.68e9, rel=0.01) and part.blocks[2] == pytest.approx(
        0.19e9, rel=0.01
    )
    assert checkpoint_plan(spec, 2, 2, 16 * 2**30)[1].bytes_per_step == 0  # every block resident


def broken_copy(nvfp4_dir, tmp_path, change):
    target = tmp_path / "broken"
    shutil.copytree(nvfp4_dir / "transformer", target)
    state = load_file(target / WEIGHTS)
    change(state)
    save_file(state, target / WEIGHTS)
    return target


LAYER = "transformer_blocks.2.attn.to_q"


def set_tensor(suffix, value):
    return lambda s: s.update({LAYER + suffix: value(s[LAYER + suffix]) if callable(value) else value})


def nan_block_scale(scale):
    bits = scale.view(torch.uint8).clone()
    bits[0, 0] = 0x7F
    return bits.view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop(LAYER + ".weight_scale_2"), f"{LAYER}.weight_scale_2 is missing"),
        (lambda s: s.pop(LAYER + ".input_scale"), f"{LAYER}.input_scale is missing"),
        (lambda s: s.pop(LAYER + ".weight_scale"), f"{LAYER}.weight_scale is missing"),
        (set_tensor(".input_scale", torch.tensor(float("nan"))), f"{LAYER}.input_scale is nan"),
        (set_tensor(".weight_scale_2", torch.tensor(0.0)), f"{LAYER}.weight_scale_2 is 0.0"),
        (set_tensor(".weight_scale_2", torch.ones(2)), rf"{LAYER}.weight_scale_2 has shape \[2\]"),
        (set_tensor(".weight_scale", lambda t: t.float()), rf"{LAYER}.weight_scale is float32 \[128, 8\]"),
        (set_tensor(".weight_scale", lambda t: t[:, :4].contiguous()), r"expected float8_e4m3fn \[128, 8\]"),
        (set_tensor(".weight_scale", nan_block_scale), f"{LAYER}.weight_scale has NaN or negative"),
        (set_tensor(".weight", lambda t: t[:, :32].contiguous()), rf"{LAYER}.weight is uint8 \[128, 32\]"),
        (set_tensor(".weight", lambda t: t.to(torch.float8_e4m3fn)), rf"{LAYER}.weight is float8_e4m3fn"),
        (
            lambda s: s.update({"proj_out.weight": s["proj_out.weight"][:, :64].to(torch.uint8)}),
            "proj_out matches an ignore pattern but is stored as NVFP4",
        ),
    ],
)
def test_a_broken_nvfp4_layer_is_refused_by_its_tensor_name(nvfp4_dir, tmp_path, change, message):
    with pytest.raises(CheckpointError, match=message) as refused:
        load_transformer(broken_copy(nvfp4_dir, tmp_path, change), build_transformer, torch.bfloat16, CPU)
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"group_size": 32}, r"NVFP4 group_size \[32\]: only 16"),
        ({"group_size": None}, "NVFP4 group_size missing"),
        ({"quant_algo": "W4A8_AWQ"}, "unsupported ModelOpt quant_algo 'W4A8_AWQ'"),
        ({"weight_only_per_channel": ["*.img_mod.1"]}, "weight_only_per_channel is for FP8"),
    ],
)
def test_a_bad_nvfp4_config_is_refused_in_one_line(nvfp4_dir, tmp_path, quant, message):
    target = tmp_path / "config"
    shutil.copytree(nvfp4_dir / "transformer", target)
    (target / "hf_quant_config.json").unlink()
    config = json.loads((target / "config.json").read_text())
    flat = config["quantization_config"] | quant
    flat["config_groups"] = {}
    config["quantization_config"] = {k: v for k, v in flat.items() if v is not None}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_transformer(target, build_transformer, torch.bfloat16, CPU)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "nvfp4", "--fp8-modulation"], "--fp8-modulation stores FP8 weight-only layers"),
        (["--model", "{nvfp4}"], "is already an NVFP4 checkpoint: quantize its BF16 source"),
    ],
)
def test_quantize_refuses_in_one_line(nvfp4_dir, tmp_path, capsys, args, message):
    args = [a.replace("{nvfp4}", str(nvfp4_dir)) for a in args]
    assert main(["quantize", "--out", str(tmp_path / "q"), "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.cpu_dtype
def test_a_lora_on_an_nvfp4_layer_is_refused_in_one_line(nvfp4_dir, tmp_path):
    pipe = load_pipeline(nvfp4_dir, device="cpu")
    shapes = linear_shapes(pipe.transformer)
    bf16_layer, nvfp4_layer = "transformer_blocks.0.attn.to_q", LAYER
    path = write_peft(
        tmp_path / "lora.safetensors", random_factors(shapes, [bf16_layer, nvfp4_layer], 4, seed=1)
    )
    with pytest.raises(CheckpointError, match=f"{nvfp4_layer} is an NVFP4 layer") as refused:
        pipe.load_lora(path)
    assert len(str(refused.value).splitlines()) == 1 and not pipe.loras
