"""qwen_image_fusion.eval.meaning: true drawings pass, contradicted descriptions fail, and the CLI writes its
report."""

import json
from dataclasses import replace

import numpy as np
import pytest

from qwen_image_fusion.eval import meaning
from qwen_image_fusion.eval.meaning import accuracy, check_image, classify_colours, shuffled_baseline
from qwen_image_fusion.eval.scenes import (
    BACKGROUNDS,
    COLOURS,
    POSITIONS,
    Background,
    Description,
    Group,
    draw_scene,
    held_out_scenes,
    render,
)

WHITE = BACKGROUNDS["white"]


def hand_drawn(size: int = 96) -> np.ndarray:
    """Drawn with numpy, not the project's renderer: a red square left, two blue discs right, a stray
    2x2 green speck (too small to be a shape) at the top, on white."""
    image = np.full((size, size, 3), WHITE, dtype=np.uint8)
    yy, xx = np.mgrid[:size, :size] / size
    image[(np.abs(xx - 0.2) < 0.1) & (np.abs(yy - 0.5) < 0.1)] = COLOURS["red"]
    for cy in (0.4, 0.6):
        image[(xx - 0.8) ** 2 + (yy - cy) ** 2 < 0.06**2] = COLOURS["blue"]
    image[10:12, 47:49] = COLOURS["green"]
    return image


def description(*groups: Group) -> Description:
    return Description(tuple(groups), Background(("white",)))


def test_a_hand_drawn_image_passes_what_it_shows_and_fails_the_rest() -> None:
    image = hand_drawn()
    shown = description(Group(1, "red", "square", "left"), Group(2, "blue", "circle", "right"))
    check = check_image(image, shown)
    assert check.colour_position and check.count and check.shape
    assert [g.found for g in check.groups] == [1, 2]
    assert not check_image(image, description(Group(1, "red", "square", "right"))).colour_position
    assert not check_image(image, description(Group(1, "green", "square", "top"))).colour_position
    wrong_count = check_image(image, description(Group(3, "blue", "circle", "right")))
    assert wrong_count.colour_position and not wrong_count.count
    assert not check_image(image, description(Group(1, "red", "circle", "left"))).shape


def test_colour_classes_are_nearest_palette_colours_within_the_distance() -> None:
    pixels = np.array([[COLOURS["red"], (200, 60, 50), (128, 255, 0), (250, 250, 250)]], dtype=np.uint8)
    names = meaning.PALETTE_NAMES
    assert [names[i] if i >= 0 else None for i in classify_colours(pixels)[0]] == [
        "red",
        "red",
        None,  # 99+ from yellow and green: no palette colour is near
        "white",
    ]


@pytest.mark.parametrize("size", [64, 256])
def test_true_renders_pass(size: int) -> None:
    scenes = held_out_scenes(100) if size == 64 else held_out_scenes(100)[:30]
    result = accuracy([check_image(render(s, size), s.description) for s in scenes])
    assert result["colour_position"] == 1.0 and result["count"] == 1.0


def test_contradicted_descriptions_fail_on_true_renders() -> None:
    """Each scene's render against its description with one group changed: colour, position or count."""
    wrong_colour = wrong_position = wrong_count = 0
    scenes = [draw_scene(11, i) for i in range(60)]
    for scene in scenes:
        image = np.asarray(render(scene, 128))
        d = scene.description
        first, rest = d.groups[0], d.groups[1:]
        used_colours = {g.colour for g in d.groups}
        used_positions = {g.position for g in d.groups}
        colour = next(c for c in COLOURS if c not in used_colours)
        position = next(p for p in POSITIONS if p not in used_positions)
        count = first.count % 3 + 1
        wrong_colour += check_image(
            image, replace(d, groups=(replace(first, colour=colour), *rest))
        ).colour_position
        wrong_position += check_image(
            image, replace(d, groups=(replace(first, position=position), *rest))
        ).colour_position
        wrong_count += check_image(image, replace(d, groups=(replace(first, count=count), *rest))).count
    assert (wrong_colour, wrong_position, wrong_count) == (0, 0, 0)


def test_blank_noise_and_other_scenes_fail() -> None:
    scenes = held_out_scenes(50)
    blank = np.full((128, 128, 3), WHITE, dtype=np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    for image in (blank, noise):
        assert accuracy([check_image(image, s.description) for s in scenes[:10]])["colour_position"] == 0.0
    images = [np.asarray(render(s, 128)) for s in scenes]
    chance = shuffled_baseline(images, [s.description for s in scenes])
    assert chance["colour_position"] <= 0.1 and chance["count"] <= 0.1


def test_cli_checks_the_true_renders(tmp_path, capsys) -> None:
    assert meaning.main(["--truth", "--scenes", "10", "--size", "64", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "meaning.json").read_text())
    assert report["accuracy"]["en"]["colour_position"] == 1.0 and report["accuracy"]["zh"]["images"] == 10
    assert len(report["scenes"]) == 10 and "colour+position 100.0%" in capsys.readouterr().out


@pytest.mark.cpu_dtype
def test_cli_generates_with_a_model_and_compares_fp8(tmp_path, capsys) -> None:
    """The embedded default (the trained model) end to end: held-out images, checks, FP8 vs BF16."""
    argv = ["--scenes", "2", "--size", "32", "--steps", "2", "--languages", "en", "--device", "cpu"]
    argv += ["--fp8", "--calib-scenes", "1", "--out", str(tmp_path)]
    assert meaning.main(argv) == 0
    report = json.loads((tmp_path / "meaning.json").read_text())
    assert report["model"] == "embedded-default" and report["accuracy"]["en"]["images"] == 2
    fp8 = report["fp8"]
    assert fp8["variant"].startswith("fp8-") and fp8["fusion_summary"].startswith("FP8 norm+quant fusion")
    assert fp8["versus_bf16"]["pairs"] == 2 and fp8["accuracy"]["en"]["images"] == 2
    names = sorted(p.name for p in (tmp_path / "images").iterdir())
    assert names == sorted(f"s00{i}-en-{v}.png" for i in (0, 1) for v in (report["variant"], fp8["variant"]))
    assert "fp8 vs bf16: PSNR" in capsys.readouterr().out


def test_cli_refuses_bad_arguments(capsys) -> None:
    assert meaning.main(["--truth", "--size", "50"]) == 2
    assert meaning.main(["--truth", "--languages", "en,fr"]) == 2
    assert meaning.main(["--model", "/nonexistent/model"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(line.startswith("error: ") for line in errors)
