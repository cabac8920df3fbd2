"""Our transformer on Edit layouts (target tokens, then one to three reference grids of odd sizes) with and
without Edit-2511's `zero_cond_t`: reference mode bit-identical (torch.equal) to diffusers'
QwenImageTransformer2DModel in fp32 and bf16, padded prompt batches included; an FP8 model with
`zero_cond_t` runs every block path fused, equals its unfused path bit for bit, and steps without a host
sync. Configs of Qwen-Image-Layered (the other variant flags) are refused in one line."""

import dataclasses
import json
import sys

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from edit_fixtures import (
    EDIT_2511,
    EDIT_LAYOUT,
    edit_step_inputs,
    fp8_edit_transformer,
    tiny_edit_transformer,
)
from helpers import RANK_SCRIPT, launch, step_without_host_sync

from qwen_image_fusion.models.errors import CheckpointError, InputError
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.math import ImageLayout
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer

TINY = dataclasses.replace(EDIT_2511, zero_cond_t=False)
LAYOUTS = {
    "one reference": ImageLayout((1, 4, 4), ((1, 3, 5),)),
    "two odd references": EDIT_LAYOUT,
    "three references": ImageLayout((1, 2, 4), ((1, 3, 3), (1, 1, 5), (1, 7, 2))),
    "no reference": ImageLayout((1, 3, 4)),
}
CASES = [  # (batch, layout, text tokens, padded prompt)
    (1, "one reference", 7, False),
    (2, "two odd references", 9, True),
    (2, "three references", 6, True),
    (1, "no reference", 5, False),
]


def config(zero_cond_t: bool) -> QwenImageConfig:
    return dataclasses.replace(TINY, zero_cond_t=zero_cond_t)


def _pair(dtype: torch.dtype, zero_cond_t: bool) -> tuple[QwenImageTransformer2DModel, QwenImageTransformer]:
    torch.manual_seed(0)
    kwargs = {k: v for k, v in config(zero_cond_t).to_dict().items() if not k.startswith("_")}
    ref = QwenImageTransformer2DModel(**kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ref = ref.to(dtype).eval()
    ours = QwenImageTransformer(config(zero_cond_t)).to(dtype).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["zero_cond_t off", "zero_cond_t on"])
@pytest.mark.parametrize(("batch", "layout", "text", "padded"), CASES)
def test_reference_mode_is_bit_exact(dtype, zero_cond_t, batch, layout, text, padded):
    ref, ours = _pair(dtype, zero_cond_t)
    layout = LAYOUTS[layout]
    latents, prompt, mask, sigma = edit_step_inputs(batch, layout, text, dtype, padded)
    with torch.no_grad():
        expected = ref(
            hidden_states=latents,
            encoder_hidden_states=prompt,
            encoder_hidden_states_mask=mask,
            timestep=sigma,
            img_shapes=[list(layout.grids)] * batch,
            return_dict=False,
        )[0]
        got = ours(latents, prompt, mask, sigma, layout)
    assert got.dtype == expected.dtype and got.shape == (batch, layout.tokens, 64)
    assert torch.equal(got, expected)


def test_zero_cond_t_changes_the_output():
    """The same weights with and without `zero_cond_t` give other velocities: the flag is not ignored."""
    layout = LAYOUTS["two odd references"]
    inputs = edit_step_inputs(2, layout, 9, torch.float32, True)
    _, off = _pair(torch.float32, False)
    on = QwenImageTransformer(config(True)).eval()
    on.load_state_dict(off.state_dict())
    with torch.no_grad():
        assert not torch.equal(on(*inputs, layout), off(*inputs, layout))


def test_modulation_index_names_each_token_row():
    """Target tokens of sample b on temb row b, its reference tokens on row B + b (the t = 0 rows)."""
    model = QwenImageTransformer(config(True))
    layout = ImageLayout((1, 2, 2), ((1, 1, 3),))
    index = model.modulation_index(layout, 2, torch.device("cpu"))
    assert index.dtype == torch.int32
    assert index.tolist() == [[0, 0, 0, 0, 2, 2, 2], [1, 1, 1, 1, 3, 3, 3]]
    assert QwenImageTransformer(TINY).modulation_index(layout, 2, torch.device("cpu")) is None


def test_layout_token_count_must_match():
    _, ours = _pair(torch.float32, True)
    latents, prompt, mask, sigma = edit_step_inputs(1, LAYOUTS["one reference"], 5, torch.float32, False)
    with pytest.raises(InputError, match=r"31 image tokens, but .* has 28"):
        ours(latents, prompt, mask, sigma, ImageLayout((1, 4, 4), ((1, 3, 4),)))


def test_config_reads_zero_cond_t_and_layered_flags_and_refuses_guidance():
    """Layered's flags are read (a non-Layered family refuses them: tests/test_layered.py); guidance
    embeddings, which no Qwen-Image checkpoint has, are refused in one line."""
    raw = {k: v for k, v in config(True).to_dict().items() if not k.startswith("_")}
    assert QwenImageConfig.from_dict(raw).zero_cond_t is True
    assert not QwenImageConfig.from_dict(raw).layered
    for flag in ("use_additional_t_cond", "use_layer3d_rope"):
        read = QwenImageConfig.from_dict(raw | {flag: True})
        assert getattr(read, flag) and read.layered and read.to_dict()[flag] is True
    with pytest.raises(CheckpointError, match="enables guidance_embeds: only the Qwen-Image") as err:
        QwenImageConfig.from_dict(raw | {"guidance_embeds": True})
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def fp8_edit() -> QwenImageTransformer:
    return fp8_edit_transformer()


def test_fp8_zero_cond_t_runs_every_path_fused_and_equals_unfused(fp8_edit: QwenImageTransformer):
    report = fp8_edit.fusion_report
    layers = fp8_edit.config.num_layers
    assert report.summary().splitlines()[0] == f"FP8 norm+quant fusion: {4 * layers}/{4 * layers} block paths"
    assert all(d.fused for d in report.mlp) and len(report.mlp) == 2 * layers
    inputs = edit_step_inputs(2, EDIT_LAYOUT, 9, torch.bfloat16, True)
    with torch.no_grad():
        fused = fp8_edit(*inputs, EDIT_LAYOUT)
        fp8_edit.post_load_weights(fuse=False)
        assert fp8_edit.fusion_report.fused == 0
        unfused = fp8_edit(*inputs, EDIT_LAYOUT)
        fp8_edit.post_load_weights()
    assert torch.equal(fused, unfused)
    assert fused.isfinite().all() and fused.abs().sum() > 0


def test_fp8_zero_cond_t_step_has_no_host_sync(fp8_edit: QwenImageTransformer):
    step_without_host_sync(fp8_edit, EDIT_LAYOUT, text_tokens=7, pad_from=4)


@pytest.mark.slow
def test_ulysses_splits_the_modulation_index_with_the_image_rows(tmp_path):
    """Two gloo ranks run one Edit-2511 step sharded (BF16 reference numerics, FP8 fused and unfused):
    each rank's image rows take their own rows of the per-token index (a whole index would not fit
    them), fused == unfused bit for bit, and the velocities are those of one process (the CPU's GEMMs
    do not depend on the row count; the keys keep one-process order)."""
    result = launch(2, [sys.executable, RANK_SCRIPT, "edit", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["no_host_sync"] and seen["fusion"] == "FP8 norm+quant fusion: 8/8 block paths"
    sharded = torch.load(tmp_path / "edit.pt")
    assert torch.equal(sharded["fp8"], sharded["fp8-unfused"])
    inputs = edit_step_inputs(2, EDIT_LAYOUT, 9, torch.bfloat16, True)
    with torch.no_grad():
        assert torch.equal(sharded["bf16"], tiny_edit_transformer()(*inputs, EDIT_LAYOUT))
        assert torch.equal(sharded["fp8"], fp8_edit_transformer()(*inputs, EDIT_LAYOUT))
