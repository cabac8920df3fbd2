"""LoRA on FP8 checkpoints (CPU, torch twins of the contract): in branch mode the gate keeps every path fused
with dual output and fused == unfused byte for byte; in merge mode the weights are requantized (clipping
reported) and fused == unfused again; unloading restores the FP8 weights exactly; `quantize --lora` bakes
the LoRA in before calibration."""

import pytest
import torch
from helpers import png_sha256
from lora_files import block_modules, linear_shapes, random_factors, write_lightning
from safetensors.torch import load_file
from torch import nn

from qwen_image_fusion.kernels.quant import FP8_MAX
from qwen_image_fusion.models.fp8 import Fp8Linear, quant_consumer_spec
from qwen_image_fusion.models.fusion import gate_path
from qwen_image_fusion.models.lora import LoraLinear, lora_layers
from qwen_image_fusion.models.lora_files import LoraFactors, read_lora_file
from qwen_image_fusion.models.qwen_image.family import FAMILY
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.lora import fp8_input_clipping
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

CPU = torch.device("cpu")
PROMPTS = ["a red fox", "a blue bird"]
ARGS = dict(negative_prompt="blurry", width=48, height=32, num_inference_steps=2, seed=11)


@pytest.fixture(scope="module")
def lightning(tmp_path_factory):
    """A Lightning-layout LoRA (bf16, rank 16, alpha 2) on every block linear of the embedded model."""
    pipe = load_pipeline(device="cpu")
    shapes = linear_shapes(pipe.transformer)
    modules = block_modules(pipe.transformer.config.num_layers)
    factors = random_factors(shapes, modules, 16, seed=5, std=0.2, dtype=torch.bfloat16)
    return write_lightning(tmp_path_factory.mktemp("lora") / "lightning.safetensors", factors, 2.0)


def _pngs(pipe) -> list[str]:
    return [png_sha256(image) for image in pipe.generate(PROMPTS, **ARGS)]


def _state(pipe) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.transformer.state_dict().items()}


@pytest.mark.cpu_dtype
def test_branch_keeps_every_path_fused_with_dual_output_and_fused_equals_unfused(fp8_dir, lightning):
    pipe = load_pipeline(fp8_dir, device="cpu")
    base = _pngs(pipe)
    pipe.load_lora(lightning, scale=0.8)
    layers = pipe.transformer.config.num_layers
    summary = pipe.fusion_summary().splitlines()
    assert summary[0] == f"FP8 norm+quant fusion: {4 * layers}/{4 * layers} block paths"
    assert (
        f"  fused ({4 * layers}): dual output (LoRA branch needs y); e.g. transformer_blocks.0.img_attn_input"
        in summary
    )
    gelu = f"  fused ({layers}): dual output (LoRA branch needs y)"  # the text stream's (img fc2 stays BF16)
    assert any(line.startswith(gelu) for line in summary)
    producer = pipe.transformer.transformer_blocks[0].img_norm1
    assert producer.quant is not None and producer.quant.write_y
    fused = _pngs(pipe)
    pipe.set_variant("fp8-unfused")
    assert _pngs(pipe) == fused
    assert fused != base and fused[0] != fused[1]
    assert "LoRA (branch): lightning x0.8" in pipe.last_run.loras


@pytest.mark.cpu_dtype
def test_merge_requantizes_reports_clipping_fused_equals_unfused_and_unload_restores(fp8_dir, lightning):
    pipe = load_pipeline(fp8_dir, device="cpu")
    base, before = _pngs(pipe), _state(pipe)
    pipe.load_lora(lightning, scale=0.8)
    branch = _pngs(pipe)
    pipe.set_lora_mode("merge")
    report = pipe.lora_merge
    assert len(report.fp8) == 11 * pipe.transformer.config.num_layers  # every FP8 linear of the blocks
    for name, stats in report.fp8.items():
        wrapper = pipe.transformer.get_submodule(name)
        fp8 = wrapper.base_layer
        assert not wrapper.branch_active() and not fp8.needs_unquantized_input
        # The new scale maps the merged weight's amax to 448: half an FP8 step at the top (16 of 448) at
        # most, and a weight beyond ±448 only by the rounding of amax / scale.
        assert fp8.weight.float().abs().max() == FP8_MAX
        assert stats.max_abs_error <= 16 * float(fp8.weight_scale)
        assert stats.clipped <= 2
        assert torch.equal(fp8.input_scale, before[f"{name}.input_scale"])
    assert "input scales kept" in report.summary() and "weights clipped at ±448" in report.summary()
    assert "dual output" not in pipe.fusion_summary()  # merged: no branch needs y
    fused = _pngs(pipe)
    pipe.set_variant("fp8-unfused")
    assert _pngs(pipe) == fused
    assert fused != branch and fused != base

    pipe.unload_lora()
    state = pipe.transformer.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], v) for k, v in before.items())
    pipe.set_variant("fp8-fused")
    assert _pngs(pipe) == base


@pytest.mark.cpu_dtype
def test_input_clipping_is_measured_against_the_calibrated_scales(fp8_dir, lightning):
    pipe = load_pipeline(fp8_dir, device="cpu")
    args = dict(width=48, height=32, num_inference_steps=2, seed=1)
    without = fp8_input_clipping(pipe, "a red fox", **args)
    pipe.load_lora(lightning, scale=1.5)
    with_lora = fp8_input_clipping(pipe, "a red fox", **args)
    assert pipe.variant == "fp8-fused"  # measured on the unfused path, then switched back
    fp8 = {
        n.removesuffix(".base_layer") for n, m in pipe.transformer.named_modules() if isinstance(m, Fp8Linear)
    }
    layers = pipe.transformer.config.num_layers
    assert set(with_lora.ratio) == set(without.ratio) == fp8 and len(fp8) == 11 * layers
    assert with_lora.ratio != without.ratio
    assert with_lora.summary().startswith("FP8 inputs: ")


def test_lora_wrapper_reads_its_base_capability():
    fp8 = Fp8Linear(32, 16)
    fp8.post_load_weights()
    wrapper = LoraLinear(fp8, {"a": 1.0})
    assert quant_consumer_spec(wrapper).needs_unquantized_input is False  # no adapter yet
    factors = LoraFactors(
        torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16), 4
    )
    wrapper.add_adapter("a", factors)
    spec = quant_consumer_spec(wrapper)
    assert spec.needs_unquantized_input and spec.unquantized_reason == "LoRA branch"
    assert spec.input_scale is fp8.input_scale and spec.quant_key == fp8.quant_key
    consumers = [("to_q", wrapper), ("to_k", Fp8Linear(32, 16))]
    consumers[1][1].post_load_weights()
    reason, _, write_y = gate_path(CPU, consumers)
    assert reason == "" and write_y is True
    assert "to_q needs the unquantized input" in gate_path(CPU, consumers, producer_writes_y=False)[0]
    wrapper.merge()
    assert quant_consumer_spec(wrapper).needs_unquantized_input is False
    assert quant_consumer_spec(LoraLinear(nn.Linear(32, 16), {})) is None


@pytest.mark.cpu_dtype
def test_quantize_bakes_the_lora_into_the_bf16_weights_before_calibration(tmp_path, lightning):
    lora = read_lora_file(lightning, FAMILY.convert_lora)
    out = quantize_checkpoint(
        None, tmp_path / "fast", prompts=["a red fox"], steps=2, size=32, device="cpu", loras=[(lora, 0.5)]
    )
    state = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    bf16 = load_pipeline(device="cpu").transformer
    for name in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.txt_mlp.net.2"):
        f = lora.factors[name]
        delta = (f.up.float() @ f.down.float()) * f.scaling(0.5)
        baked = (bf16.get_submodule(name).weight.float() + delta).to(torch.bfloat16).float()
        assert torch.equal(state[f"{name}.weight_scale"], baked.abs().amax() / FP8_MAX)
    # img_mlp.net.2 stays BF16 (fallback list) and holds the baked LoRA itself
    name = "transformer_blocks.0.img_mlp.net.2"
    f = lora.factors[name]
    baked = bf16.get_submodule(name).weight.float() + (f.up.float() @ f.down.float()) * f.scaling(0.5)
    assert torch.equal(state[f"{name}.weight"], baked.to(torch.bfloat16))
    assert not lora_layers(load_pipeline(out, device="cpu").transformer)
