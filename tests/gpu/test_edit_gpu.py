"""GPU (H200) checks of the Edit-2511 transformer (`zero_cond_t`: per-token modulation rows):

- at the model's width (24 heads x 128, two blocks, random weights), a 1024x1024 target plus a 1024x768
  reference (7168 image rows per sample, a CFG-sized batch of two, a padded prompt): every block and MLP
  path fused with the Triton producers reading the per-token index (the torch twins are not called),
  fused == unfused byte for byte, a CUDA-graph replay equals the eager step, no host sync;
- the tiny model's reference mode equals diffusers' QwenImageTransformer2DModel bit for bit on CUDA.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from edit_fixtures import EDIT_2511, EDIT_LAYOUT, edit_step_inputs, meta_transformer
from helpers import step_without_host_sync

import qwen_image_fusion.kernels.norm_modulate as norm_modulate
from qwen_image_fusion.models.calibration import (
    fp8_state_dict,
    quantizable_linears,
    record_input_amax,
    share_group_amax,
)
from qwen_image_fusion.models.loading import transformer_from_state
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.math import ImageLayout
from qwen_image_fusion.models.qwen_image.model import QUANTIZATION
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer
from qwen_image_fusion.pipelines.cuda_graph import GraphedStep

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
FULL_WIDTH = QwenImageConfig(num_layers=2, zero_cond_t=True)  # 24 x 128 heads, text 3584, RoPE 16/56/56
LAYOUT = ImageLayout((1, 64, 64), ((1, 48, 64),))  # 1024x1024 target, a 768x1024 reference
TEXT = 300


def step_inputs(config: QwenImageConfig, layout: ImageLayout) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(3)
    latents = torch.randn(2, layout.tokens, config.in_channels, device="cuda", generator=gen).bfloat16()
    prompt = torch.randn(2, TEXT, config.joint_attention_dim, device="cuda", generator=gen).bfloat16()
    mask = torch.ones(2, TEXT, dtype=torch.long, device="cuda")
    mask[1, 200:] = 0
    return latents, prompt, mask, torch.tensor([0.7, 0.7], device="cuda")


@pytest.fixture(scope="module")
def fp8_model() -> QwenImageTransformer:
    """The full-width Edit-2511 model in ModelOpt FP8 (every block linear), calibrated on one step."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = QwenImageTransformer(FULL_WIDTH).bfloat16().eval()
    linears = quantizable_linears(model, QUANTIZATION.all_blocks_fp8)
    with torch.no_grad(), record_input_amax(linears) as amax:
        model(*step_inputs(FULL_WIDTH, LAYOUT), LAYOUT)
    state = fp8_state_dict(model, linears, share_group_amax(amax, QUANTIZATION.shared_inputs))
    del model
    quant = QuantConfig("FP8", tuple(QUANTIZATION.all_blocks_fp8))
    return transformer_from_state(
        meta_transformer(FULL_WIDTH), state, quant, torch.bfloat16, Path("edit-2511-gpu")
    )


def test_every_path_fused_with_triton_and_equal_to_unfused(fp8_model, monkeypatch):
    layers = FULL_WIDTH.num_layers
    assert fp8_model.fusion_report.summary().splitlines()[0] == (
        f"FP8 norm+quant fusion: {4 * layers}/{4 * layers} block paths"
    )
    assert all(d.fused for d in fp8_model.fusion_report.mlp)

    def no_twin(*_args, **_kwargs):
        raise AssertionError("a CUDA producer fell back to its torch twin")

    for twin in (
        "layer_norm_modulate_torch",
        "gated_residual_layer_norm_modulate_torch",
        "gated_residual_torch",
    ):
        monkeypatch.setattr(norm_modulate, twin, no_twin)
    inputs = step_inputs(FULL_WIDTH, LAYOUT)
    with torch.no_grad():
        fused = fp8_model(*inputs, LAYOUT)
        fp8_model.post_load_weights(fuse=False)
        unfused = fp8_model(*inputs, LAYOUT)
        fp8_model.post_load_weights()
    assert torch.equal(fused, unfused)
    assert bool(fused.isfinite().all())


def test_cuda_graph_replay_equals_eager(fp8_model):
    inputs = step_inputs(FULL_WIDTH, LAYOUT)
    graphed = GraphedStep(lambda *args: fp8_model(*args))
    with torch.no_grad():
        eager = fp8_model(*inputs, LAYOUT)
        replayed = graphed(*inputs, static=(LAYOUT,))
        again = graphed(*inputs, static=(LAYOUT,))
    assert len(graphed.graphs) == 1
    assert torch.equal(replayed, eager) and torch.equal(again, eager)


def test_step_has_no_host_sync(fp8_model):
    step_without_host_sync(fp8_model, ImageLayout((1, 8, 8), ((1, 6, 10),)), CUDA, text_tokens=7, pad_from=5)


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_tiny_reference_mode_equals_diffusers_on_cuda(zero_cond_t):
    config = dataclasses.replace(EDIT_2511, zero_cond_t=zero_cond_t)
    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**{k: v for k, v in config.to_dict().items() if not k.startswith("_")})
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ref = ref.to(CUDA, torch.bfloat16).eval()
    ours = QwenImageTransformer(config).to(CUDA, torch.bfloat16).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    inputs = [
        t if t is None else t.to(CUDA) for t in edit_step_inputs(2, EDIT_LAYOUT, 9, torch.bfloat16, True)
    ]
    latents, prompt, mask, sigma = inputs
    with torch.no_grad():
        expected = ref(
            hidden_states=latents,
            encoder_hidden_states=prompt,
            encoder_hidden_states_mask=mask,
            timestep=sigma,
            img_shapes=[list(EDIT_LAYOUT.grids)] * 2,
            return_dict=False,
        )[0]
        got = ours(latents, prompt, mask, sigma, EDIT_LAYOUT)
    assert torch.equal(got, expected)
