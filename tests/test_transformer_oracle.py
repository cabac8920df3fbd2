"""Our transformer against diffusers' QwenImageTransformer2DModel on the same random weights: bit-exact."""

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer

TINY = QwenImageConfig(
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=48,
    axes_dims_rope=(8, 12, 12),
)


def _pair(dtype: torch.dtype) -> tuple[QwenImageTransformer2DModel, QwenImageTransformer]:
    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**{k: v for k, v in TINY.to_dict().items() if not k.startswith("_")})
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ref = ref.to(dtype).eval()
    ours = QwenImageTransformer(TINY).to(dtype).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _inputs(batch: int, grid: tuple[int, int, int], text: int, dtype: torch.dtype, padded: bool):
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, grid[0] * grid[1] * grid[2], 64, generator=gen).to(dtype)
    prompt = torch.randn(batch, text, 48, generator=gen).to(dtype)
    mask = None
    if padded:
        mask = torch.ones(batch, text, dtype=torch.long)
        mask[0, text // 2 :] = 0
    sigma = torch.rand(batch, generator=gen)
    return latents, prompt, mask, sigma


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "grid", "text", "padded"),
    [(1, (1, 4, 4), 7, False), (2, (1, 3, 5), 9, True), (2, (1, 6, 2), 5, False)],
)
def test_reference_mode_is_bit_exact(dtype, batch, grid, text, padded):
    ref, ours = _pair(dtype)
    latents, prompt, mask, sigma = _inputs(batch, grid, text, dtype, padded)
    with torch.no_grad():
        expected = ref(
            hidden_states=latents,
            encoder_hidden_states=prompt,
            encoder_hidden_states_mask=mask,
            timestep=sigma,
            img_shapes=[[grid]] * batch,
            return_dict=False,
        )[0]
        got = ours(latents, prompt, mask, sigma, grid)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


def test_contract_mode_is_close_to_reference():
    """Contract arithmetic rounds once per producer instead of per op: close, not equal, in BF16."""
    _, ours = _pair(torch.bfloat16)
    latents, prompt, mask, sigma = _inputs(2, (1, 4, 4), 7, torch.bfloat16, True)
    with torch.no_grad():
        reference = ours(latents, prompt, mask, sigma, (1, 4, 4)).float()
        ours.set_numerics("contract")
        contract = ours(latents, prompt, mask, sigma, (1, 4, 4)).float()
    assert not torch.equal(reference, contract)
    rel = (contract - reference).norm() / reference.norm()
    assert rel < 2e-2, f"contract vs reference relative error {rel:.3e}"
