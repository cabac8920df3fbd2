"""Our Qwen-Image 2.1 transformer against diffusers' `QwenImage21Transformer2DModel` on the same random
weights: bit-identical (torch.equal) in reference numerics, FP32 and BF16, for every tiny config and request
of tests/qi21_cases.py, without the KV cache and with it (prefill, then cached steps, each compared with
diffusers in the same cache mode)."""

import pytest
import torch
from qi21_cases import CONFIGS, REQUESTS, diffusers_forward, model_pair

DTYPES = [torch.float32, torch.bfloat16]
CAUSAL = [name for name, config in CONFIGS.items() if config.causal_condition]


def assert_identical(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    differ = int((got != want).sum()) if got.shape == want.shape else -1
    assert torch.equal(got, want), f"{what}: {differ} of {want.numel()} values differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("request_name", list(REQUESTS))
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_full_pass_is_bit_identical(config_name, request_name, dtype):
    ref, ours = model_pair(config_name, dtype)
    request = REQUESTS[request_name]
    latents, text, sigma = request.inputs(ours.config, dtype, seed=1)
    want = diffusers_forward(ref, request, latents, text, sigma)
    layout = ours.layout(request.img_mask(), request.img_shapes, request.text_mask())
    with torch.no_grad():
        got = ours(latents, text, sigma, layout)
    # diffusers returns every joint row; the target image's rows close the sequence
    assert_identical(got, want[:, -layout.target_len :], "target rows")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("request_name", list(REQUESTS))
@pytest.mark.parametrize("config_name", CAUSAL)
def test_kv_cached_steps_are_bit_identical(config_name, request_name, dtype):
    """Prefill (diffusers' "extract") then two target-only steps at other latents and sigmas ("cached")."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    ref, ours = model_pair(config_name, dtype)
    request = REQUESTS[request_name]
    layout = ours.layout(request.img_mask(), request.img_shapes, request.text_mask())
    cache = ours.new_kv_cache(layout, dtype)
    ref_cache = QwenImage21KVCache(ours.config.num_layers)
    latents, text, sigma = request.inputs(ours.config, dtype, seed=2)
    want = diffusers_forward(ref, request, latents, text, sigma, ref_cache, "extract")
    with torch.no_grad():
        got = ours(latents, text, sigma, layout, cache)
    assert_identical(got, want[:, -layout.target_len :], "prefill step")
    for step in (1, 2):
        new_latents, _, new_sigma = request.inputs(ours.config, dtype, seed=10 + step)
        latents = torch.cat([latents[:, : -layout.target_len], new_latents[:, -layout.target_len :]], dim=1)
        want = diffusers_forward(ref, request, latents, text, new_sigma, ref_cache, "cached")
        with torch.no_grad():
            got = ours.forward_cached(latents[:, -layout.target_len :], new_sigma, layout, cache)
        assert_identical(got, want, f"cached step {step}")


def test_reference_cases_are_not_trivial():
    """The cached steps really depend on the cached prefix and on the sigma (the comparisons above could
    not pass with a model that ignores them)."""
    _, ours = model_pair(CAUSAL[0], torch.float32)
    request = REQUESTS["one condition image, padded"]
    layout = ours.layout(request.img_mask(), request.img_shapes, request.text_mask())
    latents, text, sigma = request.inputs(ours.config, torch.float32, seed=3)
    target = latents[:, -layout.target_len :]
    with torch.no_grad():
        cache = ours.new_kv_cache(layout, torch.float32)
        ours(latents, text, sigma, layout, cache)
        step = ours.forward_cached(target, sigma, layout, cache)
        assert not torch.equal(step, ours.forward_cached(target, sigma * 0.5, layout, cache))
        ours(latents, 2 * text, sigma, layout, cache)
        assert not torch.equal(step, ours.forward_cached(target, sigma, layout, cache))
        assert not torch.equal(step[0], step[1])  # the padded sample differs


def test_contract_numerics_are_close_to_reference():
    """Contract arithmetic rounds once per producer instead of per op: close to reference, not equal."""
    _, ours = model_pair(CAUSAL[0], torch.bfloat16)
    request = REQUESTS["one condition image, padded"]
    layout = ours.layout(request.img_mask(), request.img_shapes, request.text_mask())
    latents, text, sigma = request.inputs(ours.config, torch.bfloat16, seed=4)
    try:
        with torch.no_grad():
            reference = ours(latents, text, sigma, layout).float()
            ours.set_numerics("contract")
            contract = ours(latents, text, sigma, layout).float()
    finally:
        ours.set_numerics("reference")
    assert not torch.equal(reference, contract)
    rel = (contract - reference).norm() / reference.norm()
    assert rel < 2e-2, f"contract vs reference relative error {rel:.3e}"
