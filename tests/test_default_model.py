"""The embedded default is the trained model shipped in the package: it loads as a checkpoint, draws what
the first README command asks, passes the meaning checker on held-out captions, and says what it is."""

import pytest

from qwen_image_fusion.eval.meaning import accuracy, check_image
from qwen_image_fusion.eval.scenes import Background, Description, Group, held_out_scenes
from qwen_image_fusion.models.embedded import DEFAULT_MODEL_DIR, EMBEDDED_NAME, training_record
from qwen_image_fusion.pipelines import load_pipeline
from qwen_image_fusion.pipelines.info import describe
from qwen_image_fusion.training.recipe import NEGATIVE_PROMPT

FIRST_PROMPT = "a red circle on the left and a blue square on the right"  # README command 1
FIRST_SCENE = Description(
    (Group(1, "red", "circle", "left"), Group(1, "blue", "square", "right")), Background(("white",))
)


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(device="cpu")


@pytest.mark.cpu_dtype
def test_the_default_is_the_trained_checkpoint(pipe) -> None:
    """No random weights: the DiT's parameters are the shipped safetensors', bit for bit."""
    from safetensors.torch import load_file

    shipped = load_file(DEFAULT_MODEL_DIR / "transformer" / "diffusion_pytorch_model.safetensors")
    ours = pipe.transformer.state_dict()
    assert shipped and all(ours[name].equal(tensor.to(ours[name].dtype)) for name, tensor in shipped.items())
    assert pipe.model_name == EMBEDDED_NAME


def test_the_first_readme_command_draws_what_it_says(pipe) -> None:
    """README command 1 (no true CFG, 20 steps at 256 px) on four seeds: the red blob on the left and the
    blue one on the right, by the meaning checker."""
    checks = [check_image(pipe.generate(FIRST_PROMPT, seed=seed)[0], FIRST_SCENE) for seed in range(4)]
    assert all(check.colour_position for check in checks), [c.as_dict() for c in checks]


def test_held_out_captions_in_both_languages(pipe) -> None:
    """A small subset of the held-out evaluation (captions never trained on), English and Chinese, as the
    model was trained to be sampled: true CFG 4 with the dropout prompt as the negative."""
    scenes = held_out_scenes(4)
    checks = [
        check_image(
            pipe.generate(scene.captions[lang], negative_prompt=NEGATIVE_PROMPT, seed=i)[0], scene.description
        )
        for i, scene in enumerate(scenes)
        for lang in ("en", "zh")
    ]
    assert accuracy(checks)["colour_position"] >= 0.75, [c.as_dict() for c in checks]


def test_info_says_what_it_is_and_how_it_was_trained(pipe) -> None:
    text = describe(pipe)
    record = training_record()
    assert "trained: on drawn scenes" in text
    assert f"DiT {record['dit_run']['dit']['steps']} steps" in text
    assert f"VAE {record['vae_run']['vae']['steps']} steps" in text
    assert "width 128" in text and "noise" not in text
