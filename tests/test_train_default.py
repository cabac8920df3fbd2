"""training/: the smoke run end to end (train -> tar -> assemble -> load_pipeline -> generate), and the
conventions the DiT is trained with checked against the pipeline that samples it."""

import json
import tarfile

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from qwen_image_fusion.eval.scenes import draw_scene, render
from qwen_image_fusion.models.family import Conditioning
from qwen_image_fusion.models.qwen_image.config import vae_scale_factor
from qwen_image_fusion.models.qwen_image.text_encoder import VOCAB_SIZE
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.stages import denoise
from qwen_image_fusion.training import assemble, train_default
from qwen_image_fusion.training.recipe import RECIPES, build_text_encoder, build_transformer, build_vae
from qwen_image_fusion.training.train_default import (
    flow_matching_pair,
    model_latents,
    render_scenes,
    shifted_sigma,
    to_vae_input,
)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    assert (
        train_default.main(["--preset", "smoke", "--out", str(out), "--workers", "1", "--device", "cpu"]) == 0
    )
    checkpoint = tmp_path_factory.mktemp("ckpt") / "model"
    assert assemble.main([str(out / train_default.TAR_NAME), str(checkpoint)]) == 0
    return out, checkpoint


def test_smoke_run_writes_one_small_tar_with_a_loss_log(smoke_run) -> None:
    out, _ = smoke_run
    tar_path = out / train_default.TAR_NAME
    assert tar_path.stat().st_size <= train_default.MAX_TAR_BYTES
    with tarfile.open(tar_path) as tar:
        names = set(tar.getnames())
        meta = json.load(tar.extractfile("train_meta.json"))
        rows = [json.loads(line) for line in tar.extractfile("train_log.jsonl").read().splitlines()]
    assert {
        "vae/config.json",
        "transformer/config.json",
        "samples/s000-en.png",
        "samples/s001-zh.png",
    } <= names
    sizes = RECIPES["smoke"]
    assert [r["step"] for r in rows if r["stage"] == "vae"] == list(range(1, sizes.vae_steps + 1))
    assert [r["step"] for r in rows if r["stage"] == "dit"] == list(range(1, sizes.dit_steps + 1))
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert meta["text_encoder"]["hidden_size"] == sizes.text_hidden and meta["negative_prompt"] == " "
    assert set(meta["dit"]["held_out_samples"]) == {"en", "zh"}


@pytest.mark.cpu_dtype
def test_the_assembled_checkpoint_loads_and_generates(smoke_run) -> None:
    _, checkpoint = smoke_run
    assert json.loads((checkpoint / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"
    pipe = load_pipeline(checkpoint, device="cpu")
    size = RECIPES["smoke"].image_size
    image = pipe.generate(
        "a red circle on the left",
        negative_prompt=" ",
        width=size,
        height=size,
        num_inference_steps=2,
        seed=0,
    )
    assert image[0].size == (size, size)
    # the VAE carries the latent statistics measured on its own latents, not the defaults
    assert pipe.components.vae.config.latents_mean != build_vae(RECIPES["smoke"].vae).config.latents_mean
    # the text encoder is the deterministic one, stored once (tied embeddings) in bf16
    stored = load_file(checkpoint / "text_encoder" / "model.safetensors")
    assert not any("lm_head" in name for name in stored)
    reference = build_text_encoder(RECIPES["smoke"].text_hidden).get_input_embeddings().weight
    embedding = next(t for name, t in stored.items() if name.endswith("embed_tokens.weight"))
    assert embedding.shape == (VOCAB_SIZE, RECIPES["smoke"].text_hidden) and embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, reference.to(torch.bfloat16))
    assert (checkpoint / "training" / "train_meta.json").is_file()
    scores = json.loads((checkpoint / "training" / "held_out_samples.json").read_text())
    assert sorted(scores) == ["en", "zh"] and scores["en"]["images"] == RECIPES["smoke"].held_out_samples


def test_assemble_refuses_what_is_not_a_training_tar(tmp_path, capsys) -> None:
    bogus = tmp_path / "bogus.tar"
    with tarfile.open(bogus, "w") as tar:
        tar.add(__file__, arcname="something.py")
    assert assemble.main([str(bogus), str(tmp_path / "out")]) == 2
    assert assemble.main([str(tmp_path / "missing.tar"), str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("error: ") and "not a train_default output" in lines[0]
    assert lines[1].startswith("error: training tar not found")


def test_parallel_rendering_equals_inline_rendering() -> None:
    inline, captions = render_scenes(seed=5, count=10, size=32, workers=1)
    forked, forked_captions = render_scenes(seed=5, count=10, size=32, workers=2)
    assert np.array_equal(inline, forked) and captions == forked_captions
    assert np.array_equal(inline[3], np.asarray(render(draw_scene(5, 3), 32)))
    assert captions[6:8] == [draw_scene(5, 3).captions["en"], draw_scene(5, 3).captions["zh"]]


def test_training_sigmas_follow_the_pipelines_shifted_schedule() -> None:
    """DESIGN §2: mu = 0.5 + (0.9 - 0.5) / (8192 - 256) * (tokens - 256), sigma = e^mu / (e^mu + 1/u - 1)."""
    u = torch.linspace(0.05, 1.0, 20, dtype=torch.float64)
    for tokens in (4, 256, 1024):
        mu = 0.5 + (0.9 - 0.5) / (8192 - 256) * (tokens - 256)
        expected = np.exp(mu) / (np.exp(mu) + 1 / u - 1)
        assert torch.allclose(shifted_sigma(u, tokens), expected, rtol=1e-12, atol=0)


def test_a_model_predicting_the_training_target_denoises_to_x0_in_the_pipeline(smoke_run) -> None:
    """Train-time noising (x_t, target) and the pipeline's Euler loop agree: an oracle that returns the
    training target for the x0 it knows lands the pipeline exactly on that x0 (fp32)."""
    _, checkpoint = smoke_run
    pipe = load_pipeline(checkpoint, device="cpu", dtype="fp32")
    side = 32
    tokens = (side // (2 * pipe.vae_scale_factor)) ** 2
    x0 = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(3))

    def oracle(latents, embeds, mask, sigma, grid):
        noise = (latents - (1 - sigma[:, None, None]) * x0) / sigma[:, None, None]
        return flow_matching_pair(x0, noise, sigma)[1]

    pipe.model.run_step = oracle  # the transformer call, replaced
    embeds = torch.zeros(1, 3, RECIPES["smoke"].text_hidden)
    result = denoise(pipe, [Conditioning(embeds, None)], pipe.model.canvas(side, side), 8, 1.0, seed=1)
    assert torch.allclose(result, x0, atol=1e-4)


def test_model_latents_are_what_the_pipeline_decodes(smoke_run) -> None:
    """Normalised, packed training latents decode through the pipeline's decoding to the VAE's own
    decoding of the raw latents (the latents_mean/std round trip)."""
    _, checkpoint = smoke_run
    pipe = load_pipeline(checkpoint, device="cpu", dtype="fp32")
    vae = pipe.components.vae
    size = RECIPES["smoke"].image_size
    images = torch.from_numpy(np.stack([np.asarray(render(draw_scene(9, i), size)) for i in range(2)]))
    with torch.no_grad():
        z = vae.encode(to_vae_input(images)).latent_dist.mode()[:, :, 0]
        mean, std = torch.tensor(vae.config.latents_mean), torch.tensor(vae.config.latents_std)
        decoded = pipe.model.decode(model_latents(z, mean, std).float(), pipe.model.canvas(size, size)).images
        direct = pipe.model.image_processor.postprocess(
            vae.decode(z[:, :, None]).sample[:, :, 0], output_type="pil"
        )
    for a, b in zip(decoded, direct, strict=True):
        diff = np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int))
        assert diff.max() <= 2 and diff.mean() < 0.2  # bf16 rounding of the packed latents only


def test_transformer_starts_as_identity_blocks_and_zero_output() -> None:
    config = RECIPES["smoke"].dit
    model = build_transformer(config, seed=0)
    again = build_transformer(config, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    x = torch.randn(2, 4, 64)
    out = model(x, torch.randn(2, 3, config.joint_attention_dim), None, torch.tensor([0.3, 0.9]), (1, 2, 2))
    assert torch.equal(out, torch.zeros_like(out))


def test_default_sizes_fit_the_budget() -> None:
    """The shipped preset: at most ~20 MB of bf16 safetensors in all (text encoder stored once)."""
    sizes = RECIPES["default"]
    counts = {
        "text_encoder": sum(p.numel() for p in build_text_encoder(sizes.text_hidden).parameters()),
        "transformer": sum(p.numel() for p in build_transformer(sizes.dit, seed=0).parameters()),
        "vae": sum(p.numel() for p in build_vae(sizes.vae).parameters()),
    }
    assert 2 * sum(counts.values()) <= 20.5e6, counts
    assert sizes.image_size % (2 * vae_scale_factor(sizes.vae)) == 0 and sizes.vae["z_dim"] == 16


def test_a_second_run_can_reuse_the_vae(smoke_run, tmp_path) -> None:
    out, _ = smoke_run
    source = out / train_default.TAR_NAME
    argv = ["--preset", "smoke", "--out", str(tmp_path), "--workers", "1", "--device", "cpu"]
    assert train_default.main([*argv, "--vae-from", str(source), "--dit-steps", "2"]) == 0
    with tarfile.open(source) as a, tarfile.open(tmp_path / train_default.TAR_NAME) as b:
        weights = "vae/diffusion_pytorch_model.safetensors"
        first = load_safetensors(a.extractfile(weights).read())
        second = load_safetensors(b.extractfile(weights).read())
        meta = json.load(b.extractfile("train_meta.json"))
        rows = [json.loads(line) for line in b.extractfile("train_log.jsonl").read().splitlines()]
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert meta["vae"]["from"] == str(source) and {r["stage"] for r in rows} == {"dit"}


def _weights(tar_path) -> dict[str, torch.Tensor]:
    with tarfile.open(tar_path) as tar:
        return {
            name: tensor
            for component in ("vae", "transformer")
            for name, tensor in load_safetensors(
                tar.extractfile(f"{component}/diffusion_pytorch_model.safetensors").read()
            ).items()
        } | {"pixels": torch.tensor(list(tar.extractfile("samples/s000-en.png").read()))}


def test_the_seed_reproduces_the_run_on_a_cpu(smoke_run, tmp_path) -> None:
    """Same seed: the same VAE, DiT and samples bit for bit (the GPU reproduces quality only); another
    seed: other weights."""
    out, _ = smoke_run
    argv = ["--preset", "smoke", "--workers", "1", "--device", "cpu"]
    assert train_default.main([*argv, "--out", str(tmp_path / "again")]) == 0
    assert train_default.main([*argv, "--out", str(tmp_path / "other"), "--seed", "1"]) == 0
    first = _weights(out / train_default.TAR_NAME)
    again = _weights(tmp_path / "again" / train_default.TAR_NAME)
    other = _weights(tmp_path / "other" / train_default.TAR_NAME)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first if k != "pixels")
