"""Qwen-Image 2.1 transformer loading and FP8 on CPU: a diffusers-saved directory loads bit-identically; a
calibrated ModelOpt FP8 checkpoint (Q/K/V and gate_layer/proj sharing input scales) loads with every producer
path fused, fused == unfused bit for bit in the full pass and the KV-cached steps; the target-only step makes
no host syncs and reuses the cache's buffers in place; broken checkpoints are refused in one line."""

import json
import shutil

import pytest
import torch
from helpers import NoHostSync
from qi21_cases import CONFIGS, REQUESTS, diffusers_forward, model_pair
from safetensors.torch import load_file, save_file

from qwen_image_fusion.models.calibration import (
    fp8_state_dict,
    quantizable_linears,
    record_input_amax,
    share_group_amax,
)
from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.fp8 import Fp8Linear
from qwen_image_fusion.models.loading import load_transformer
from qwen_image_fusion.models.qwen_image21.loading import build_transformer21
from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION
from qwen_image_fusion.pipelines.quantize import quantization_configs, write_modelopt_transformer

CPU = torch.device("cpu")
CONFIG = next(name for name, config in CONFIGS.items() if config.causal_condition)
REQUEST = REQUESTS["one condition image, padded"]


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """diffusers' tiny 2.1 transformer (random BF16 weights) as `save_pretrained` writes it."""
    ref, _ = model_pair(CONFIG, torch.bfloat16)
    directory = tmp_path_factory.mktemp("qi21") / "transformer"
    ref.save_pretrained(directory)
    return directory


def request_inputs(model, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """REQUEST's BF16 inputs from `seed` on the model's device."""
    latents, text, sigma = REQUEST.inputs(model.config, torch.bfloat16, seed)
    return latents.to(model.device), text.to(model.device), sigma.to(model.device)


def run_steps(model, steps: int = 2, seed: int = 5) -> list[torch.Tensor]:
    """A request's full pass filling a KV cache, then `steps` target-only steps (other latents, sigmas)."""
    layout = model.layout(REQUEST.img_mask(), REQUEST.img_shapes, REQUEST.text_mask())
    cache = model.new_kv_cache(layout, torch.bfloat16)
    latents, text, sigma = request_inputs(model, seed)
    with torch.no_grad():
        outs = [model(latents, text, sigma, layout, cache)]
        for step in range(steps):
            target, _, sigma = request_inputs(model, seed + 1 + step)
            outs.append(model.forward_cached(target[:, -layout.target_len :], sigma, layout, cache))
    return outs


def quantize(model, directory, ignore):
    """Calibrate input amax over a few steps, share it within Q/K/V and gate_layer/proj, write ModelOpt
    FP8 (the members of a group read one activation, so sharing only matters for other calibrations)."""
    linears = quantizable_linears(model, ignore)
    with record_input_amax(linears) as amax:
        run_steps(model, steps=1, seed=7)
        run_steps(model, steps=1, seed=8)
    state = fp8_state_dict(model, linears, share_group_amax(amax, QUANTIZATION.shared_inputs))
    write_modelopt_transformer(model, state, quantization_configs(WeightFormat.FP8, ignore), directory)
    return directory


@pytest.fixture(scope="module")
def fp8_dir(bf16_dir, tmp_path_factory):
    model = load_transformer(bf16_dir, build_transformer21, torch.bfloat16, CPU)
    return quantize(model, tmp_path_factory.mktemp("qi21fp8") / "transformer", QUANTIZATION.all_blocks_fp8)


def test_diffusers_directory_loads_bit_identically(bf16_dir):
    ref, _ = model_pair(CONFIG, torch.bfloat16)
    model = load_transformer(bf16_dir, build_transformer21, torch.bfloat16, CPU)
    assert not model.is_fp8 and model.fusion_report.fused == 0
    layout = model.layout(REQUEST.img_mask(), REQUEST.img_shapes, REQUEST.text_mask())
    latents, text, sigma = REQUEST.inputs(model.config, torch.bfloat16, seed=1)
    want = diffusers_forward(ref, REQUEST, latents, text, sigma)
    with torch.no_grad():
        assert torch.equal(model(latents, text, sigma, layout), want[:, -layout.target_len :])


def test_checkpoint_shares_input_scales(fp8_dir):
    state = load_file(fp8_dir / "diffusion_pytorch_model.safetensors")
    block = "transformer_blocks.0."
    for group in (("attn.to_q", "attn.to_k", "attn.to_v"), ("img_mlp.gate_layer", "img_mlp.proj")):
        scales = [state[f"{block}{name}.input_scale"] for name in group]
        assert all(torch.equal(scales[0], s) for s in scales), group
        assert all(state[f"{block}{name}.weight"].dtype == torch.float8_e4m3fn for name in group)
    assert state[block + "img_mlp.out.weight"].dtype == torch.float8_e4m3fn
    assert state["modulation.1.weight"].dtype == torch.bfloat16
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["ignore"] == list(
        QUANTIZATION.all_blocks_fp8
    )


def test_every_path_fused_on_cpu_and_reported(fp8_dir):
    model = load_transformer(fp8_dir, build_transformer21, torch.bfloat16, CPU)
    layers = model.config.num_layers
    assert model.is_fp8 and sum(isinstance(m, Fp8Linear) for m in model.modules()) == 7 * layers
    summary = model.fusion_report.summary().splitlines()
    assert summary == [
        f"FP8 norm+quant fusion: {2 * layers}/{2 * layers} block paths",
        f"FP8 SwiGLU+quant fusion: {layers}/{layers} MLP paths",
    ]


def test_fused_equals_unfused_bit_for_bit(fp8_dir):
    fused = load_transformer(fp8_dir, build_transformer21, torch.bfloat16, CPU)
    unfused = load_transformer(fp8_dir, build_transformer21, torch.bfloat16, CPU)
    report = unfused.post_load_weights(fuse=False)
    assert report.fused == 0 and "fusion switched off" in report.summary()
    got, want = run_steps(fused), run_steps(unfused)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: {int((a != b).sum())} values differ"
    assert not torch.equal(got[1], got[2])


def test_fp8_is_close_to_bf16(bf16_dir, fp8_dir):
    bf16 = run_steps(load_transformer(bf16_dir, build_transformer21, torch.bfloat16, CPU))
    fp8 = run_steps(load_transformer(fp8_dir, build_transformer21, torch.bfloat16, CPU))
    for a, b in zip(fp8, bf16, strict=True):
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert 0 < rel < 0.25, rel


def test_default_fallback_keeps_the_mlp_output_in_bf16(bf16_dir, tmp_path):
    model = load_transformer(bf16_dir, build_transformer21, torch.bfloat16, CPU)
    fp8 = load_transformer(
        quantize(model, tmp_path / "t", QUANTIZATION.bf16_fallback), build_transformer21, torch.bfloat16, CPU
    )
    layers = fp8.config.num_layers
    summary = fp8.fusion_report.summary()
    assert f"FP8 norm+quant fusion: {2 * layers}/{2 * layers} block paths" in summary
    assert f"FP8 SwiGLU+quant fusion: 0/{layers} MLP paths" in summary
    assert "BF16 consumers (layer not quantized)" in summary


def test_unshared_input_scales_are_refused_by_the_gate(fp8_dir, tmp_path):
    def edit(state):
        for name in ("transformer_blocks.0.img_mlp.proj", "transformer_blocks.1.attn.to_k"):
            state[f"{name}.input_scale"] = 2 * state[f"{name}.input_scale"]

    fp8 = load_transformer(
        _edited_copy(fp8_dir, tmp_path, state_edit=edit), build_transformer21, torch.bfloat16, CPU
    )
    layers = fp8.config.num_layers
    summary = fp8.fusion_report.summary()
    assert f"FP8 norm+quant fusion: {2 * layers - 2}/{2 * layers} block paths" in summary
    assert "input scales of img_mlp.gate_layer and img_mlp.proj differ" in summary
    assert "input scales of attn.to_q and attn.to_k differ" in summary


class NoDataDependentShapes(NoHostSync):
    """NoHostSync, and also no op whose output shape depends on tensor values (on CUDA each is a sync):
    nonzero, masked_select, boolean indexing, repeat_interleave by a tensor."""

    SIZE_FROM_DATA = ("aten::nonzero", "aten::masked_select", "aten::unique_dim", "aten::_unique2")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        bool_index = name.startswith("aten::index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args
            if isinstance(a, (list, tuple))
            for i in a
        )
        repeats = name == "aten::repeat_interleave" and func._overloadname == "Tensor"  # repeats a tensor
        if name in self.SIZE_FROM_DATA or bool_index or repeats:
            raise AssertionError(f"data-dependent shape in the denoise step: {name}")
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_guard_catches_data_dependent_shapes():
    values, keep = torch.ones(3), torch.tensor([True, False, True])
    for op in (lambda: values[keep], lambda: keep.nonzero(), lambda: values.repeat_interleave(keep.long())):
        with pytest.raises(AssertionError, match="data-dependent shape"), NoDataDependentShapes():
            op()


@pytest.mark.parametrize("fuse", [True, False])
def test_steps_make_no_host_sync_and_reuse_the_cache_in_place(fp8_dir, fuse):
    model = load_transformer(fp8_dir, build_transformer21, torch.bfloat16, CPU)
    model.post_load_weights(fuse=fuse)
    layout = model.layout(REQUEST.img_mask(), REQUEST.img_shapes, REQUEST.text_mask())
    cache = model.new_kv_cache(layout, torch.bfloat16)
    latents, text, sigma = REQUEST.inputs(model.config, torch.bfloat16, seed=9)
    target = latents[:, -layout.target_len :]
    prefix = slice(0, layout.prefix_len)
    with torch.no_grad(), NoDataDependentShapes():
        model(latents, text, sigma, layout, cache)
        address, prefix_kv = cache.buffers.data_ptr(), cache.buffers[:, :, :, prefix].clone()
        first = model.forward_cached(target, sigma, layout, cache)
        target_kv = cache.buffers[:, :, :, layout.prefix_len :].clone()
        model.forward_cached(2 * target, sigma, layout, cache)
    assert cache.buffers.data_ptr() == address
    assert torch.equal(cache.buffers[:, :, :, prefix], prefix_kv)  # the prefix is written once
    assert not torch.equal(cache.buffers[:, :, :, layout.prefix_len :], target_kv)  # target rows rewritten
    cache.buffers[:, :, :, prefix] = 0  # the step reads the cached prefix, it does not recompute it
    with torch.no_grad():
        assert not torch.equal(model.forward_cached(target, sigma, layout, cache), first)


def test_cache_misuse_is_refused():
    _, model = model_pair(CONFIG, torch.float32)
    layout = model.layout(REQUEST.img_mask(), REQUEST.img_shapes, REQUEST.text_mask())
    other = model.layout(REQUEST.img_mask(), REQUEST.img_shapes, None)
    cache = model.new_kv_cache(layout, torch.float32)
    latents, text, sigma = REQUEST.inputs(model.config, torch.float32, seed=1)
    target = latents[:, -layout.target_len :]
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="run the full pass"):
            model.forward_cached(target, sigma, layout, cache)
        with pytest.raises(ValueError, match="another layout"):
            model(latents, text, sigma, other, cache)
        with pytest.raises(ValueError, match="do not fit"):
            model(latents[:, 1:], text, sigma, layout)
    _, not_causal = model_pair(next(n for n, c in CONFIGS.items() if not c.causal_condition), torch.float32)
    with pytest.raises(ValueError, match="needs causal_condition"):
        not_causal.new_kv_cache(not_causal.layout(REQUEST.img_mask(), REQUEST.img_shapes), torch.float32)


def _edited_copy(source, tmp_path, config_edit=None, state_edit=None):
    target = tmp_path / "edited"
    shutil.copytree(source, target)
    if config_edit is not None:
        config = json.loads((target / "config.json").read_text())
        config_edit(config)
        (target / "config.json").write_text(json.dumps(config))
    if state_edit is not None:
        path = target / "diffusion_pytorch_model.safetensors"
        state = load_file(path)
        state_edit(state)
        save_file(state, path)
    return target


@pytest.mark.parametrize(
    ("config_edit", "message"),
    [
        (lambda c: c.update(_class_name="QwenImageTransformer2DModel"), "is for QwenImageTransformer2DModel"),
        (lambda c: c.update(attention_head_dim=30), "attention_head_dim 30 must equal sum"),
        (lambda c: c.update(axes_dims_rope=[8, 11, 13]), "three positive even integers"),
        (lambda c: c.update(num_layers=0), "num_layers must be a positive integer"),
        (lambda c: c.update(mlp_ratio=2.5), "mlp_ratio must be a positive integer"),
        (lambda c: c.update(eps=-1), "eps must be a finite number > 0"),
        (lambda c: c.update(causal_condition="yes"), "causal_condition must be true or false"),
    ],
)
def test_bad_config_is_refused_in_one_line(bf16_dir, tmp_path, config_edit, message):
    directory = _edited_copy(bf16_dir, tmp_path, config_edit=config_edit)
    with pytest.raises(CheckpointError, match=message) as err:
        load_transformer(directory, build_transformer21, torch.bfloat16, CPU)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("state_edit", "message"),
    [
        (lambda s: s.pop("transformer_blocks.1.img_mlp.gate_layer.weight"), "1 tensors missing"),
        (lambda s: s.update(extra=torch.zeros(1)), "1 unexpected tensors"),
        (
            lambda s: s.update({"modulation.1.weight": s["modulation.1.weight"][:-1]}),
            r"modulation.1.weight has shape \[255, 64\], expected \[256, 64\]",
        ),
    ],
)
def test_bad_tensor_is_refused_in_one_line(bf16_dir, tmp_path, state_edit, message):
    directory = _edited_copy(bf16_dir, tmp_path, state_edit=state_edit)
    with pytest.raises(CheckpointError, match=message):
        load_transformer(directory, build_transformer21, torch.bfloat16, CPU)


@pytest.mark.parametrize(
    ("state_edit", "message"),
    [
        (lambda s: s.pop("transformer_blocks.0.img_mlp.proj.input_scale"), "proj.input_scale is missing"),
        (
            lambda s: s.update({"transformer_blocks.1.attn.to_k.weight_scale": torch.tensor(float("inf"))}),
            "to_k.weight_scale is inf",
        ),
        (
            lambda s: s.update({"proj_out.weight": s["proj_out.weight"].to(torch.float8_e4m3fn)}),
            "proj_out matches an ignore pattern but is stored as FP8",
        ),
    ],
)
def test_broken_fp8_checkpoint_is_refused(fp8_dir, tmp_path, state_edit, message):
    directory = _edited_copy(fp8_dir, tmp_path, state_edit=state_edit)
    with pytest.raises(CheckpointError, match=message):
        load_transformer(directory, build_transformer21, torch.bfloat16, CPU)
