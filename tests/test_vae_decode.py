"""The opt-in fast decode (models/vae_decode.py): the 2D form of a single frame's causal convolutions is the
same mathematics as diffusers' decode (float64 agrees to rounding), shares the VAE's tensors, falls back to
the exact decode where it does not apply, says which ran (`DecodeReport`, the run's `RunInfo.decode`), and
reaches a request from every front end (test_front_ends.py)."""

import logging
from dataclasses import replace

import pytest
import torch
from diffusers import AutoencoderKLQwenImage
from edit_fixtures import tiny_vae
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.vae_decode import LOG, DecodeReport, decode_frames
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.generation_request import resolve_request


def exact(vae: AutoencoderKLQwenImage, z: torch.Tensor) -> torch.Tensor:
    return vae.decode(z, return_dict=False)[0][:, :, 0]


def fast_decode(vae: AutoencoderKLQwenImage, z: torch.Tensor) -> torch.Tensor:
    """The fast decode's pixels, checked to come from the 2D form: its report says so, and the one 3D
    convolution that ran is the 1x1x1 post-quant convolution (the exact decode runs every causal convolution
    of the decoder as one)."""
    with ConvCount() as count:
        pixels, report = decode_frames(vae, z, fast=True)
    assert report == DecodeReport(fast=True, tiled=False) and count.conv3d == 1 < count.conv2d
    return pixels


class ConvCount(TorchDispatchMode):
    """Counts the 2D and 3D convolutions that run inside it."""

    def __enter__(self) -> "ConvCount":
        self.conv2d = self.conv3d = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            dims = args[1].dim() - 2
            self.conv2d += dims == 2
            self.conv3d += dims == 3
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch", [1, 3])
def test_the_2d_form_is_the_decode_in_float64(batch: int) -> None:
    """With the zero terms dropped the sums are the same sums: in float64 only rounding separates them."""
    vae = tiny_vae(3).double()
    z = torch.randn(batch, 16, 1, 6, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    reference, fast = exact(vae, z), fast_decode(vae, z)
    assert fast.shape == reference.shape == (batch, 3, 48, 80)
    assert (fast - reference).abs().max().item() < 1e-12 * max(1.0, reference.abs().max().item())
    assert reference.abs().max().item() > 0.01  # the VAE is not a constant


def test_the_2d_form_in_bf16_stays_within_a_few_levels() -> None:
    vae = tiny_vae(4).to(torch.bfloat16)
    z = torch.randn(2, 16, 1, 8, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    levels = lambda x: ((x.float() + 1) * 127.5).round()  # noqa: E731 (the 8-bit levels of [-1, 1] pixels)
    diff = (levels(fast_decode(vae, z)) - levels(exact(vae, z))).abs()
    print(
        f"bf16 fast decode: max {diff.max().item():.0f} levels, {(diff > 0).float().mean().item():.1%} moved"
    )
    assert diff.max().item() <= 4


def test_it_runs_the_vaes_own_modules_and_leaves_them_as_they_were() -> None:
    """The fast form reads each conv's weight when it runs (a memory plan replaces parameters as it places
    them: models/streaming.py), and afterwards every conv runs diffusers' forward again."""
    vae = tiny_vae(5)
    z = torch.randn(1, 16, 1, 4, 6, generator=torch.Generator().manual_seed(4))
    reference, fast = exact(vae, z), fast_decode(vae, z)
    assert not any("forward" in vars(m) for m in vae.decoder.modules())
    assert torch.equal(exact(vae, z), reference)
    for module in vae.decoder.modules():  # new Parameter objects, as a placement makes them
        for key, param in list(module._parameters.items()):
            module._parameters[key] = torch.nn.Parameter(param.detach().clone(), requires_grad=False)
    assert torch.equal(fast_decode(vae, z), fast)
    conv = vae.decoder.conv_out
    conv._parameters["weight"] = torch.nn.Parameter(conv.weight.detach() * 2, requires_grad=False)
    assert not torch.equal(fast_decode(vae, z), fast)


def test_tiled_decoding_and_other_vaes_fall_back_exactly(caplog: pytest.LogCaptureFixture) -> None:
    vae = tiny_vae(6)
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                      tile_sample_stride_width=16)  # fmt: skip
    z = torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    LOG.addHandler(caplog.handler)  # the CLI, run in-process by other tests, stops it propagating
    try:
        with caplog.at_level(logging.WARNING, logger="qwen_image"):
            pixels, report = decode_frames(vae, z, fast=True)
    finally:
        LOG.removeHandler(caplog.handler)
    assert torch.equal(pixels, exact(vae, z))
    tiled = "the VAE decodes this size in tiles (memory plan)"
    assert report == DecodeReport(fast=False, tiled=True, fallback=tiled)
    assert "decodes this size in tiles" in caplog.text


def test_a_request_asks_for_it_and_the_run_says_so() -> None:
    pipe = load_pipeline(device="cpu", dtype="fp32")
    values = {"width": 48, "height": 32, "num_inference_steps": 2, "seed": 3, "output_type": "pil"}
    plain = pipe.generate("a lighthouse at dusk", **values)
    assert pipe.last_run.decode == DecodeReport(fast=False, tiled=False)
    fast = pipe.generate("a lighthouse at dusk", fast_decode=True, **values)
    assert pipe.last_run.decode == DecodeReport(fast=True, tiled=False)
    a, b = (torch.tensor(list(image[0].getdata()), dtype=torch.int32) for image in (plain, fast))
    assert (a - b).abs().max().item() <= 2  # FP32: the same sums in another order


def test_a_run_whose_vae_tiles_says_the_fast_decode_fell_back() -> None:
    """The decode stage decides, and the run records its decision: a fast decode asked of a VAE that tiles
    this size (as a memory plan sets it) runs exactly, in tiles, and `RunInfo.decode` says why."""
    pipe = load_pipeline(device="cpu", dtype="fp32")
    values = {"width": 64, "height": 64, "num_inference_steps": 2, "seed": 3}
    exact_image = pipe.generate("a lighthouse at dusk", **values)[0]
    pipe.components.vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32,
                                      tile_sample_stride_height=16, tile_sample_stride_width=16)  # fmt: skip
    try:
        tiled = pipe.generate("a lighthouse at dusk", fast_decode=True, **values)[0]
        assert pipe.last_run.decode == DecodeReport(
            fast=False, tiled=True, fallback="the VAE decodes this size in tiles (memory plan)"
        )
        assert tiled.tobytes() == pipe.generate("a lighthouse at dusk", **values)[0].tobytes()
    finally:
        pipe.components.vae.disable_tiling()
    assert pipe.generate("a lighthouse at dusk", **values)[0].tobytes() == exact_image.tobytes()


def test_a_checkpoint_without_the_2d_form_refuses_it() -> None:
    spec = replace(load_pipeline(device="cpu", dtype="fp32").spec, fast_decode=False)
    with pytest.raises(InputError, match=r"fast_decode: .* has no faster form"):
        resolve_request(spec, "x", fast_decode=True)
    with pytest.raises(InputError, match="fast_decode must be true or false, not 'yes'"):
        resolve_request(spec, "x", fast_decode="yes")


def test_eval_variants_name_it() -> None:
    from qwen_image_fusion.eval.variants import parse_variant
    from qwen_image_fusion.pipelines.variants import VARIANTS

    spec = parse_variant("fp8-fused+fast-decode+cache:fast:cpu:bf16", VARIANTS)
    assert (spec.name, spec.fast_decode, spec.cache, spec.device) == ("fp8-fused", True, "fast", "cpu")
    assert not parse_variant("fp8-fused:cuda", VARIANTS).fast_decode
