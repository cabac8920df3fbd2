"""NVFP4 through the family seam (issue 52): Edit-2511 and Qwen-Image 2.1 checkpoints built with diffusers'
classes are quantized to NVFP4 by the shared `quantize` (the default BF16 rules from each part's own block
count), load into the weight path and generate; each stored layer holds the quantizer's bytes of its BF16
weight; Edit-2511's per-token modulation runs W4A4 fused as unfused."""

import json

import pytest
import torch
from edit_fixtures import SMALL_CONDITION_AREA, SMALL_VAE_AREA, build_edit_checkpoint, drawn_image
from helpers import png_sha256
from qi21_checkpoints import RESOLUTION, build_qi21_checkpoint
from safetensors.torch import load_file

from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.nvfp4 import Nvfp4Linear, quantize_nvfp4_weight
from qwen_image_fusion.models.qwen_image.model import QUANTIZATION
from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION as QUANTIZATION21
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint
from qwen_image_fusion.pipelines.requests import edit_requests_for

pytestmark = pytest.mark.slow
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def stored_layers_are_the_quantizers_bytes(source, out) -> int:
    """How many NVFP4 layers `out` stores, each checked against the quantizer of `source`'s BF16 weight."""
    bf16, state = load_file(source / WEIGHTS), load_file(out / WEIGHTS)
    names = [k.removesuffix(".weight_scale_2") for k in state if k.endswith(".weight_scale_2")]
    for name in names:
        packed, block_scale, weight_scale_2 = quantize_nvfp4_weight(bf16[f"{name}.weight"].bfloat16())
        assert torch.equal(state[f"{name}.weight"], packed), name
        assert torch.equal(state[f"{name}.weight_scale"].view(torch.uint8), block_scale.view(torch.uint8))
        assert torch.equal(state[f"{name}.weight_scale_2"], weight_scale_2), name
    return len(names)


@pytest.mark.cpu_dtype
def test_qwen_image_21_keeps_its_edge_blocks_by_its_own_count(tmp_path):
    source = build_qi21_checkpoint(tmp_path / "bf16", num_layers=5)
    out = quantize_checkpoint(source, tmp_path / "nvfp4", ["a red fox"], steps=2, size=64, weights="nvfp4")
    config = json.loads((out / "transformer" / "config.json").read_text())["quantization_config"]
    edges = [f"transformer_blocks.{i}.*" for i in (0, 1, 3, 4)]
    assert config["ignore"] == [*QUANTIZATION21.outside_blocks, *edges]
    assert stored_layers_are_the_quantizers_bytes(source, out) == 7  # block 2: q, k, v, out, the MLP's 3
    assert inspect_checkpoint(out).weights is WeightFormat.NVFP4
    pipe = load_pipeline(out, device="cpu")
    pipe.model.resolution = RESOLUTION
    assert pipe.variant == "nvfp4"
    layers = [n for n, m in pipe.transformer.named_modules() if isinstance(m, Nvfp4Linear)]
    assert layers and all(n.startswith("transformer_blocks.2.") for n in layers)
    image = pipe.generate("a red fox", image=drawn_image(96, 64, seed=3, mode="RGBA"), num_inference_steps=2)[
        0
    ]
    assert image.size == (64, 64)


@pytest.mark.cpu_dtype
def test_an_edit_2511_checkpoint_quantizes_every_block_when_asked_and_edits(tmp_path, monkeypatch):
    monkeypatch.setattr("qwen_image_fusion.models.qwen_image_edit.model.VAE_AREA", SMALL_VAE_AREA)
    monkeypatch.setattr("qwen_image_fusion.models.qwen_image_edit.model.CONDITION_AREA", SMALL_CONDITION_AREA)
    source = build_edit_checkpoint(tmp_path / "bf16", "QwenImageEditPlusPipeline", zero_cond_t=True, seed=2)
    keep = QUANTIZATION.outside_blocks  # two blocks: the default would keep both
    requests = edit_requests_for(3)[:1]
    out = quantize_checkpoint(source, tmp_path / "nvfp4", requests, keep, steps=2, size=32, weights="nvfp4")
    per_block = 14  # modulation 2, attention 8, MLPs 4
    assert stored_layers_are_the_quantizers_bytes(source, out) == 2 * per_block
    pipe = load_pipeline(out, device="cpu")
    assert pipe.variant == "nvfp4" and pipe.spec.images_required
    args = dict(image=[drawn_image(75, 53, 1)], width=48, height=32, num_inference_steps=2, seed=5)
    edited = pipe.generate("make the sky red", negative_prompt="blurry", **args)[0]
    assert edited.size == (48, 32)
    # W4A4 with Edit-2511's per-token modulation (the twins on the CPU): every block path fuses, and the
    # fused producers give the unfused path's bytes
    pngs = {}
    for variant in ("nvfp4-w4a4-fused", "nvfp4-w4a4-unfused"):
        pipe.set_variant(variant)
        pngs[variant] = png_sha256(pipe.generate("make the sky red", negative_prompt="blurry", **args)[0])
        if variant.endswith("-fused"):
            paths = 4 * pipe.transformer.config.num_layers
            assert pipe.fusion_summary().startswith(f"NVFP4 norm+quant fusion: {paths}/{paths}")
    assert pngs["nvfp4-w4a4-fused"] == pngs["nvfp4-w4a4-unfused"] != png_sha256(edited)
