"""Checkpoints whose configs differ from Qwen-Image's own, built and saved by diffusers itself: other
latent channel counts, VAE depths (4x and 16x), head counts, text widths and a tokenizer class without
Unicode normalization. Each loads from its own configs and equals diffusers' `QwenImagePipeline`
pixel for pixel in reference mode; quantized, fused and unfused FP8 give identical bytes; components that
do not fit together, and broken files, are refused with one line naming both values or the tensor.
"""

import json
import shutil
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from diffusers import QwenImagePipeline as DiffusersQwenImagePipeline
from helpers import fill_deterministic, png_sha256
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLForConditionalGeneration

from qwen_image_fusion.models.errors import CheckpointError
from qwen_image_fusion.models.qwen_image.components import Components, default_scheduler
from qwen_image_fusion.models.qwen_image.text_encoder import build_tiny_text_encoder
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.quantize import quantize_checkpoint
from qwen_image_fusion.ui.cli import main

NFD_PROMPT = unicodedata.normalize("NFD", "Crème brûlée au café, 한국어 간판")


@dataclass(frozen=True)
class Variant:
    """One checkpoint shape: transformer, VAE and text-encoder sizes, and the tokenizer class."""

    name: str
    latent_channels: int
    vae_dim_mult: tuple[int, ...]
    heads: int
    head_dim: int
    axes_dims_rope: tuple[int, int, int]
    text_hidden: int
    normalizing_tokenizer: bool
    size: tuple[int, int]  # (width, height), multiples of the VAE scale x 2

    @property
    def vae_scale(self) -> int:
        return 2 ** (len(self.vae_dim_mult) - 1)


VARIANTS = [
    Variant("z8-vae4x-3x16-text32", 8, (1, 2, 4), 3, 16, (4, 6, 6), 32, False, (40, 24)),
    Variant("z4-vae16x-4x8-text96", 4, (1, 1, 2, 2, 2), 4, 8, (2, 2, 4), 96, False, (64, 32)),
    Variant("z16-vae8x-2x32-text64", 16, (1, 2, 4, 4), 2, 32, (8, 12, 12), 64, True, (48, 32)),
]


def plain_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """The real Qwen2 BPE as a plain tokenizers-backed class with no normalizer (unlike Qwen2Tokenizer)."""
    build_qwen2_tokenizer().save_pretrained(directory)
    tokenizer_json = json.loads((directory / "tokenizer.json").read_text())
    tokenizer_json["normalizer"] = None
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return PreTrainedTokenizerFast.from_pretrained(directory)


def build_checkpoint(variant: Variant, directory: Path) -> Path:
    """Random weights in diffusers' own classes, written by diffusers' `save_pretrained`."""
    z = variant.latent_channels
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * z,
        out_channels=z,
        num_layers=2,
        attention_head_dim=variant.head_dim,
        num_attention_heads=variant.heads,
        joint_attention_dim=variant.text_hidden,
        axes_dims_rope=variant.axes_dims_rope,
    )
    fill_deterministic(transformer, seed=len(variant.name))
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=z,
        dim_mult=list(variant.vae_dim_mult),
        num_res_blocks=1,
        temperal_downsample=[False] + [True] * (len(variant.vae_dim_mult) - 2),
        latents_mean=[0.05 * i for i in range(z)],
        latents_std=[1.0 + 0.1 * i for i in range(z)],
    )
    fill_deterministic(vae, seed=7)
    tokenizer = (
        build_qwen2_tokenizer() if variant.normalizing_tokenizer else plain_tokenizer(directory / "tok")
    )
    pipe = DiffusersQwenImagePipeline(
        scheduler=default_scheduler(),
        vae=vae,
        text_encoder=build_tiny_text_encoder(seed=3, hidden_size=variant.text_hidden),
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(directory / "model")
    return directory / "model"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Variant], Path]:
    """Each variant's checkpoint, built once in this module (the build is deterministic)."""
    checkpoints: dict[str, Path] = {}

    def get(variant: Variant) -> Path:
        if variant.name not in checkpoints:
            checkpoints[variant.name] = build_checkpoint(variant, tmp_path_factory.mktemp(variant.name))
        return checkpoints[variant.name]

    return get


@pytest.fixture(scope="module")
def reference_pipeline() -> Callable[[Path, torch.dtype], Any]:
    """Our reference pipeline of a checkpoint in a dtype, loaded once in this module (the tests only
    generate with it and read its parts)."""
    pipes: dict[tuple[Path, torch.dtype], Any] = {}

    def get(directory: Path, dtype: torch.dtype) -> Any:
        if (directory, dtype) not in pipes:
            pipes[directory, dtype] = load_pipeline(directory, variant="reference", device="cpu", dtype=dtype)
        return pipes[directory, dtype]

    return get


@pytest.fixture(scope="module", params=VARIANTS, ids=[v.name for v in VARIANTS])
def checkpoint(request: pytest.FixtureRequest, built: Callable[[Variant], Path]) -> tuple[Variant, Path]:
    return request.param, built(request.param)


CASES = {
    "single, no CFG": dict(prompt="a red fox in the snow", negative_prompt=None),
    "padded batch, true CFG": dict(
        prompt=["a cat", "一只熊猫在竹林里吃竹子，水墨画"], negative_prompt=["blurry", " "]
    ),
    "NFD prompt, true CFG": dict(prompt=NFD_PROMPT, negative_prompt="low quality"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_mode_equals_diffusers_from_pretrained(
    checkpoint: tuple[Variant, Path],
    dtype: torch.dtype,
    reference_pipeline: Callable[[Path, torch.dtype], Any],
) -> None:
    variant, directory = checkpoint
    ours = reference_pipeline(directory, dtype)
    theirs = DiffusersQwenImagePipeline.from_pretrained(directory, dtype=dtype)
    theirs.set_progress_bar_config(disable=True)
    assert ours.vae_scale_factor == theirs.vae_scale_factor == variant.vae_scale
    assert type(ours.components.tokenizer) is type(theirs.tokenizer)
    width, height = variant.size
    for name, case in CASES.items():
        kwargs = dict(width=width, height=height, num_inference_steps=2, true_cfg_scale=4.0)
        got = ours.generate(**case, seed=5, **kwargs)
        expected = theirs(**case, generator=torch.Generator("cpu").manual_seed(5), **kwargs).images
        assert len(got) == len(expected), name
        for a, b in zip(got, expected, strict=True):
            assert a.size == (width, height), name
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"{variant.name} {name}: pixels differ"
        assert np.asarray(got[0]).std() > 1.0, f"{name}: a flat image proves nothing"


def test_nfd_prompt_is_tokenized_as_the_checkpoint_tokenizer_does(
    checkpoint: tuple[Variant, Path], reference_pipeline: Callable[[Path, torch.dtype], Any]
) -> None:
    """A tokenizer without normalizer keeps decomposed accents as their own tokens; ours must too."""
    variant, directory = checkpoint
    tokenizer = reference_pipeline(directory, torch.float32).components.tokenizer
    nfc = unicodedata.normalize("NFC", NFD_PROMPT)
    same = tokenizer(NFD_PROMPT).input_ids == tokenizer(nfc).input_ids
    assert same is variant.normalizing_tokenizer


@pytest.mark.cpu_dtype
def test_quantized_fused_equals_unfused(checkpoint: tuple[Variant, Path], tmp_path: Path) -> None:
    variant, directory = checkpoint
    width, height = variant.size
    fp8 = quantize_checkpoint(directory, tmp_path / "fp8", prompts=["a red fox"], steps=2, size=width)
    hashes = {}
    pipe = load_pipeline(fp8, variant="fp8-fused", device="cpu")
    for name in ("fp8-fused", "fp8-unfused"):
        pipe.set_variant(name)
        paths = 4 * pipe.transformer.config.num_layers
        fused = paths if name == "fp8-fused" else 0
        assert pipe.fusion_summary().splitlines()[0] == f"FP8 norm+quant fusion: {fused}/{paths} block paths"
        images = pipe.generate(
            ["a cat", NFD_PROMPT],
            negative_prompt=" ",
            width=width,
            height=height,
            num_inference_steps=2,
            seed=1,
        )
        hashes[name] = [png_sha256(image) for image in images]
    assert hashes["fp8-fused"] == hashes["fp8-unfused"]


def _edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.fixture(scope="module")
def small_checkpoint(built: Callable[[Variant], Path]) -> Path:
    return built(VARIANTS[0])


@pytest.fixture
def copy_of(small_checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of the first variant's checkpoint that a test may break."""
    return Path(shutil.copytree(small_checkpoint, tmp_path / "copy"))


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    """The CLI's stderr holds exactly one `error:` line and no traceback; returns it."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_disagreeing_components_are_refused_before_loading(
    copy_of: Path, capsys: pytest.CaptureFixture
) -> None:
    vae_config = json.loads((copy_of / "vae" / "config.json").read_text())
    z = vae_config["z_dim"]
    _edit_json(copy_of / "vae" / "config.json", z_dim=z + 1)
    assert main(["info", "--model", str(copy_of), "--device", "cpu"]) == 2
    err = one_error_line(capsys)
    assert f"in_channels {4 * z}" in err and f"z_dim is {z + 1}" in err


def test_text_width_mismatch_names_both_values(copy_of: Path) -> None:
    config = json.loads((copy_of / "transformer" / "config.json").read_text())
    _edit_json(
        copy_of / "transformer" / "config.json", joint_attention_dim=config["joint_attention_dim"] + 32
    )
    with pytest.raises(
        CheckpointError, match=r"joint_attention_dim \d+ differs from the text encoder's hidden_size"
    ):
        load_pipeline(copy_of, device="cpu")


@pytest.mark.cpu_dtype
def test_vae_tensor_shape_mismatch_names_file_tensor_and_shapes(
    copy_of: Path, capsys: pytest.CaptureFixture
) -> None:
    path = copy_of / "vae" / "diffusion_pytorch_model.safetensors"
    state = load_file(path)
    name = "decoder.conv_in.weight"
    wrong = state[name][:, :-1].contiguous()
    save_file(state | {name: wrong}, path)
    assert main(["info", "--model", str(copy_of), "--device", "cpu"]) == 2
    err = one_error_line(capsys)
    assert str(path) in err and name in err
    assert str(list(wrong.shape)) in err and str(list(state[name].shape)) in err


def test_a_file_given_as_model_is_not_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    assert main(["generate", "a cat", "--model", str(path), "-o", str(tmp_path / "a.png")]) == 2
    assert capsys.readouterr().err.strip() == f"error: model path {path} is a file, not a directory"


@pytest.mark.cpu_dtype
def test_tokenizer_class_from_model_index_must_exist(copy_of: Path) -> None:
    _edit_json(copy_of / "model_index.json", tokenizer=["transformers", "NoSuchTokenizer"])
    with pytest.raises(CheckpointError, match="'NoSuchTokenizer': not a transformers tokenizer"):
        load_pipeline(copy_of, device="cpu")


def test_text_encoder_of_another_width_is_refused(
    small_checkpoint: Path, reference_pipeline: Callable[[Path, torch.dtype], Any]
) -> None:
    """The same check also guards components assembled in memory."""
    hidden = VARIANTS[0].text_hidden
    c = reference_pipeline(small_checkpoint, torch.float32).components
    other = Qwen2_5_VLForConditionalGeneration(build_tiny_text_encoder(1, hidden + 32).config)
    with pytest.raises(CheckpointError, match=f"joint_attention_dim {hidden} differs"):
        Components(c.tokenizer, other, c.transformer, c.vae, c.scheduler)
