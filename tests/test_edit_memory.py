"""GPU-memory plans for the Edit family: its input images counted in every phase (vision tower and tokens in
the text encoder, their latents in each transformer call, their VAE encode), the plans of Edit-2511's full
sizes at 16 and 24 GiB, and edits under streaming placements giving the resident edit's bytes (the CPU
standing in for the device)."""

from pathlib import Path

import pytest
from edit_fixtures import (
    SMALL_CONDITION_AREA,
    SMALL_VAE_AREA,
    build_edit_checkpoint,
    drawn_image,
    our_edit_pipeline,
)
from helpers import png_sha256
from memory_fixtures import FP32, placed_pipeline

from bench.activation_memory import encode_peak, transformer_peak, vision_peak
from bench.header_checkpoint import header_only_checkpoint
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.text_encoder import qwen25_vl_7b_config
from qwen_image_fusion.models.qwen_image_edit.config import CONDITION_AREA, VAE_AREA
from qwen_image_fusion.models.streaming import HostLink
from qwen_image_fusion.pipelines.memory_plan import STREAM, GiB, default_workload, plan_memory
from qwen_image_fusion.ui.cli import main


@pytest.fixture(scope="module")
def full_size_edit(tmp_path_factory):
    """Edit-2511's sizes (FP8 transformer with zero_cond_t, Qwen2.5-VL-7B with its vision tower), headers
    only."""
    directory = header_only_checkpoint(tmp_path_factory.mktemp("edit-2511-fp8"), edit=True)
    spec = inspect_checkpoint(directory)
    return spec, spec.family.memory_profile(spec, 2, 2)


def test_input_images_add_to_every_phase(full_size_edit):
    spec, profile = full_size_edit
    act = profile.activations
    plain, edit = Workload(1024, 1024), Workload(1024, 1024, input_images=1)
    assert act.encode(edit) > act.encode(plain)
    assert act.step(Workload(1024, 1024, input_images=3)) > act.step(edit) > act.step(plain)
    assert act.decode(Workload(256, 256, input_images=1), False) > act.decode(Workload(256, 256), False)
    assert default_workload(spec).input_images == spec.max_images == 3


def test_edit_activation_estimates_bound_what_traces_allocate(full_size_edit):
    """At full width: a transformer call with one input image (fake tensors, one block: a step's peak is one
    block's), the VAE encode of a 1024x1024 input (fake tensors); the vision tower at its real width on one
    384x384-area image (real tensors, two layers, one of them full attention)."""
    act = full_size_edit[1].activations
    assert act.input_tokens() >= VAE_AREA // 256 and act.vision_patches() >= CONDITION_AREA // 14**2
    traced = transformer_peak(QwenImageConfig(num_layers=1, zero_cond_t=True), 1024, 128, references=1)
    assert traced <= act.step(Workload(1024, 1024, text_tokens=128, input_images=1))
    assert encode_peak({}, 1024) <= act.decode(Workload(64, 64, input_images=1), tiled=True)
    vision = qwen25_vl_7b_config(vision=True).vision_config
    vision.depth, vision.fullatt_block_indexes = 2, [1]
    plain = act.encode(Workload(1024, 1024))
    assert vision_peak(vision, 1, 392) <= act.encode(Workload(1024, 1024, input_images=1)) - plain


@pytest.mark.cpu_dtype
@pytest.mark.parametrize("budget", [16, 24])
def test_full_size_edit_plans_at_16_and_24_gib(full_size_edit, budget, capsys):
    """`info --gpu-memory` prints Edit-2511's plan for three input images before loading anything; every
    phase fits, and more input images stream more."""
    spec, profile = full_size_edit
    plan = plan_memory(profile, budget * GiB, default_workload(spec))
    assert plan.fits(plan.peaks) and plan.placement("transformer").mode == STREAM
    one = plan_memory(profile, budget * GiB, Workload(1024, 1024, input_images=1))
    assert one.bytes_per_step < plan.bytes_per_step
    assert (
        main(["info", "--model", str(spec.directory), "--gpu-memory", f"{budget}GiB"]) == 2
    )  # no weights to load
    out = capsys.readouterr().out
    assert f"GPU memory plan for {budget}.0 GiB (1024x1024, 1 image, 3 input images" in out


STREAMED_EDIT = dict(prompt="make it blue", width=32, height=32, num_inference_steps=2, seed=5)
STREAMED_EDIT |= dict(negative_prompt=" ", true_cfg_scale=4.0)


@pytest.fixture(scope="module")
def resident_edit(tmp_path_factory) -> tuple[Path, dict, str]:
    """A tiny Edit-2511 checkpoint, an edit of two input images and the PNG hash of that edit with every
    weight resident."""
    root = tmp_path_factory.mktemp("edit-memory")
    directory = build_edit_checkpoint(root / "plus-2511", "QwenImageEditPlusPipeline", True, seed=4)
    request = STREAMED_EDIT | dict(image=[drawn_image(40, 24, 1), drawn_image(24, 32, 2)])
    return directory, request, png_sha256(our_edit_pipeline(directory).generate(**request)[0])


@pytest.mark.parametrize(("text", "blocks", "lend"), [(("offload", 0), 0, False), (("offload", 1), 1, True)])
def test_an_edit_under_a_streaming_placement_gives_the_resident_bytes(resident_edit, text, blocks, lend):
    """A tiny Edit-2511 checkpoint with two input images, the text encoder offloaded (its layers streamed)
    and transformer blocks streamed (or lending their memory to the text encoder): the edit's PNG bytes
    equal the resident edit's, and a request carrying its input images fits the plan's budget."""
    directory, request, resident = resident_edit
    pipe = placed_pipeline(directory, "reference", text, blocks, HostLink(), precision=FP32, lend=lend)
    pipe.model.vae_area, pipe.model.condition_area = SMALL_VAE_AREA, SMALL_CONDITION_AREA
    assert pipe.memory.plan.placement("transformer").streamed
    assert png_sha256(pipe.generate(**request)[0]) == resident
