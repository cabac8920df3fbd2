"""FP8 transformer end to end on CPU: quantize the embedded model, load it, fused == unfused, no host syncs,
and refusal of broken ModelOpt checkpoints."""

import json
import shutil

import pytest
import torch
from helpers import NoHostSync, png_sha256, step_without_host_sync
from safetensors.torch import load_file, save_file

from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.loading import load_transformer
from qwen_image_fusion.models.qwen_image.components import build_transformer
from qwen_image_fusion.models.qwen_image.model import QUANTIZATION
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.ui.cli import main

CPU = torch.device("cpu")


@pytest.mark.cpu_dtype
def test_quantized_copy_keeps_the_defaults_of_its_source(fp8_dir):
    """An FP8 copy of the embedded model runs at its small size, steps and CFG, not at 1024x1024."""
    copy, source = inspect_checkpoint(fp8_dir), inspect_checkpoint(None)
    assert copy.fp8 and not source.fp8
    assert copy.defaults == source.defaults and copy.defaults.width < 1024


def test_quantized_checkpoint_layout_and_scales(fp8_dir):
    config = json.loads((fp8_dir / "transformer" / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "modelopt" and quant["quant_algo"] == "FP8"
    assert quant["ignore"] == list(QUANTIZATION.bf16_fallback)
    state = load_file(fp8_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    block = "transformer_blocks.0."
    assert state[block + "attn.to_q.weight"].dtype == torch.float8_e4m3fn
    assert state[block + "img_mlp.net.2.weight"].dtype == torch.bfloat16  # fallback list keeps it BF16
    assert state[block + "txt_mlp.net.2.weight"].dtype == torch.float8_e4m3fn
    for stream in (("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj")):
        scales = [state[f"{block}attn.{n}.input_scale"] for n in stream]
        assert all(torch.equal(scales[0], s) for s in scales), "Q/K/V of a stream must share one input scale"
    weight_scale = state[block + "attn.to_q.weight_scale"]
    assert weight_scale.dtype == torch.float32 and weight_scale.numel() == 1 and weight_scale.item() > 0
    # The FP8 weight reaches the top of the E4M3 range: weight_scale is amax/448.
    assert state[block + "attn.to_q.weight"].float().abs().max().item() == 448.0


@pytest.mark.cpu_dtype
def test_loads_with_every_path_fused_and_reports_it(fp8_dir):
    pipe = load_pipeline(fp8_dir, device="cpu")
    assert pipe.variant == "fp8-fused"
    layers = pipe.transformer.config.num_layers
    assert (
        pipe.fusion_summary().splitlines()[0]
        == f"FP8 norm+quant fusion: {4 * layers}/{4 * layers} block paths"
    )


@pytest.mark.cpu_dtype
def test_info_reports_the_quantization(fp8_dir, capsys):
    assert main(["info", "--model", str(fp8_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    layers = json.loads((fp8_dir / "transformer" / "config.json").read_text())["num_layers"]
    linears = 11 * layers  # per block: 6 attention inputs + 2 outputs + 2 MLP-in + txt MLP-out
    assert f"quantization: ModelOpt FP8, {linears} FP8 linears" in out
    assert "kept BF16: img_in, txt_in" in out


@pytest.mark.cpu_dtype
def test_fused_and_unfused_pngs_are_byte_identical(fp8_dir):
    pipe = load_pipeline(fp8_dir, device="cpu")
    args = dict(negative_prompt="blurry", width=48, height=32, num_inference_steps=3, seed=11)
    fused = [png_sha256(im) for im in pipe.generate(["a red fox", "a blue bird"], **args)]
    pipe.set_variant("fp8-unfused")
    assert "0/" in pipe.fusion_summary().splitlines()[0]
    unfused = [png_sha256(im) for im in pipe.generate(["a red fox", "a blue bird"], **args)]
    assert fused == unfused
    assert fused[0] != fused[1]


@pytest.mark.cpu_dtype
def test_environment_switch_forces_the_unfused_path(fp8_dir, monkeypatch):
    monkeypatch.setenv("QWEN_IMAGE_FP8_FUSION", "0")
    pipe = load_pipeline(fp8_dir, device="cpu")
    assert "fusion switched off" in pipe.fusion_summary()
    assert pipe.variant == "fp8-unfused"  # the label follows what runs, not what was asked


@pytest.mark.cpu_dtype
@pytest.mark.parametrize("variant", ["fp8-fused", "fp8-unfused"])
def test_transformer_step_has_no_host_sync(fp8_dir, variant):
    pipe = load_pipeline(fp8_dir, variant=variant, device="cpu")
    step_without_host_sync(pipe.transformer, (1, 4, 4))


@pytest.mark.cpu_dtype
def test_fp8_output_projections_take_the_attention_rows_without_a_copy(fp8_dir):
    """FP8 `to_out` / `to_add_out` get row slices of the joint attention output, not copies: the
    quantizer reads each sample's rows in place."""
    model = load_pipeline(fp8_dir, device="cpu").transformer
    attn = model.transformer_blocks[0].attn
    seen = {}
    hooks = [
        linear.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, args[0]))
        for name, linear in (("img", attn.to_out[0]), ("txt", attn.to_add_out))
    ]
    latents = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    prompt = torch.randn(2, 5, model.config.joint_attention_dim, dtype=torch.bfloat16)
    with torch.no_grad():
        model(latents, prompt, torch.ones(2, 5, dtype=torch.long), torch.full((2,), 0.5), (1, 4, 4))
    for hook in hooks:
        hook.remove()
    assert set(seen) == {"img", "txt"}
    img, txt = seen["img"], seen["txt"]
    assert img.untyped_storage().data_ptr() == txt.untyped_storage().data_ptr()  # one joint buffer
    assert not img.is_contiguous() and not txt.is_contiguous()


def test_guard_catches_a_sync():
    with pytest.raises(AssertionError, match="host synchronisation"), NoHostSync():
        torch.ones(3).sum().item()


def _broken_copy(fp8_dir, tmp_path, edit) -> torch.device:
    target = tmp_path / "broken"
    shutil.copytree(fp8_dir / "transformer", target)
    path = target / "diffusion_pytorch_model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path)
    return target


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("transformer_blocks.0.attn.to_k.input_scale"), "to_k.input_scale is missing"),
        (lambda s: s.pop("transformer_blocks.1.attn.to_v.weight_scale"), "to_v.weight_scale is missing"),
        (
            lambda s: s.update({"transformer_blocks.0.attn.to_q.input_scale": torch.tensor(0.0)}),
            "to_q.input_scale is 0.0",
        ),
        (
            lambda s: s.update({"transformer_blocks.0.attn.to_q.input_scale": torch.tensor(float("nan"))}),
            "to_q.input_scale is nan",
        ),
        (
            lambda s: s.update({"transformer_blocks.0.attn.to_q.weight_scale": torch.tensor(-1.0)}),
            "to_q.weight_scale is -1.0",
        ),
        (
            lambda s: s.update({"transformer_blocks.0.attn.to_q.input_scale": torch.tensor([1.0, 2.0])}),
            "to_q.input_scale has shape [2]",
        ),
        (
            lambda s: s.update(
                {"transformer_blocks.0.attn.to_q.input_scale": torch.tensor(1, dtype=torch.int32)}
            ),
            "to_q.input_scale has dtype torch.int32",
        ),
        (
            lambda s: s.update(
                {
                    "transformer_blocks.0.attn.to_q.weight": s[
                        "transformer_blocks.0.attn.to_q.weight"
                    ].bfloat16()
                }
            ),
            "to_q.weight is torch.bfloat16, expected float8_e4m3fn",
        ),
        (
            lambda s: s.update(
                {
                    "transformer_blocks.0.attn.to_q.weight": s["transformer_blocks.0.attn.to_q.weight"][
                        :, :16
                    ].contiguous()
                }
            ),
            "to_q.weight has shape",
        ),
        (
            lambda s: s.update({"proj_out.weight": s["proj_out.weight"].to(torch.float8_e4m3fn)}),
            "proj_out matches an ignore pattern but is stored as FP8",
        ),
    ],
)
def test_broken_checkpoints_are_refused(fp8_dir, tmp_path, edit, message):
    directory = _broken_copy(fp8_dir, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_transformer(directory, build_transformer, torch.bfloat16, CPU)


def test_nested_hf_quant_config_is_understood(fp8_dir, tmp_path):
    target = tmp_path / "nested"
    shutil.copytree(fp8_dir / "transformer", target)
    config = json.loads((target / "config.json").read_text())
    config.pop("quantization_config")
    (target / "config.json").write_text(json.dumps(config))
    model = load_transformer(target, build_transformer, torch.bfloat16, CPU)
    assert model.is_fp8 and model.fusion_report.fused == 4 * model.config.num_layers
    (target / "hf_quant_config.json").unlink()
    with pytest.raises(CheckpointError, match="no ModelOpt quantization_config"):
        load_transformer(target, build_transformer, torch.bfloat16, CPU)
