"""qwen_image_fusion.eval.scenes: determinism from the seed, the held-out split, captions in both languages,
ground truth."""

import hashlib
import random
import subprocess
import sys

import numpy as np
import pytest

from qwen_image_fusion.eval import scenes
from qwen_image_fusion.eval.scenes import (
    ANCHORS,
    BACKGROUND_ZH,
    BACKGROUNDS,
    CELL_HALF,
    COLOUR_ZH,
    COLOURS,
    COUNT_EN,
    COUNT_ZH,
    POSITION_EN,
    POSITION_ZH,
    SHAPE_NAMES,
    draw_scene,
    held_out_scenes,
    pixel_box,
    render,
)


def packed(rgb: np.ndarray | tuple[int, int, int]) -> np.ndarray:
    """RGB triples as one integer each (fast to compare as sets)."""
    return np.asarray(rgb, dtype=np.int64) @ np.array([65536, 256, 1])


def pixels_sha(scene: scenes.Scene, size: int) -> str:
    return hashlib.sha256(np.asarray(render(scene, size)).tobytes()).hexdigest()


def test_a_scene_depends_only_on_its_seed_and_index() -> None:
    first = draw_scene(3, 7)
    np.random.seed(1)  # global RNG state must play no part
    random.seed(1)
    again = draw_scene(3, 7)
    assert again == first and again.captions == first.captions
    assert pixels_sha(again, 64) == pixels_sha(first, 64)
    others = [draw_scene(3, 8), draw_scene(4, 7)]
    assert all(o.description != first.description or o.captions != first.captions for o in others)


def test_a_fresh_process_draws_the_same_scene() -> None:
    code = (
        "import hashlib, numpy as np; from qwen_image_fusion.eval.scenes import draw_scene, render; "
        "s = draw_scene(3, 7); "
        "print(s.captions['en']); print(hashlib.sha256(np.asarray(render(s, 64)).tobytes()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    scene = draw_scene(3, 7)
    assert out.stdout.splitlines() == [scene.captions["en"], pixels_sha(scene, 64)]


def test_held_out_scenes_never_come_from_the_training_stream() -> None:
    held = held_out_scenes(100)
    assert len(held) == 100 and all(s.description.is_held_out() for s in held)
    assert len({s.description for s in held}) == 100
    held_keys = {s.description.object_key() for s in held}
    held_captions = {s.captions[lang] for s in held for lang in ("en", "zh")}
    assert len(held_captions) == 200
    training = [draw_scene(seed, i) for seed in (0, 1) for i in range(2500)]
    assert not any(s.description.is_held_out() for s in training)
    assert not held_keys & {s.description.object_key() for s in training}
    assert not held_captions & {s.captions[lang] for s in training for lang in ("en", "zh")}


def test_the_held_out_bucket_is_about_two_percent_of_descriptions() -> None:
    descriptions = [scenes.sample_description(np.random.default_rng([99, i])) for i in range(4000)]
    share = np.mean([d.is_held_out() for d in descriptions])
    assert 0.01 <= share <= 0.035


def test_english_and_chinese_captions_state_the_same_description() -> None:
    for scene in [draw_scene(5, i) for i in range(300)]:
        en, zh = scene.captions["en"], scene.captions["zh"]
        d = scene.description
        for g in d.groups:
            name, plural = SHAPE_NAMES[g.shape]
            shape_en = plural if g.count > 1 else name.en
            count_en = COUNT_EN.get(g.count, "")
            phrase = f"{count_en} {g.colour} {shape_en}" if g.count > 1 else f"{g.colour} {shape_en}"
            assert any(f"{phrase} {where}" in en for where in POSITION_EN[g.position]), (en, g)
            assert any(f"{where}有{COUNT_ZH[g.count]}" in zh for where in POSITION_ZH[g.position]), (zh, g)
            assert COLOUR_ZH[g.colour] in zh and name.zh in zh
        for colour in d.background.colours:
            assert colour in en and BACKGROUND_ZH[colour] in zh
        if d.sign is not None:
            assert f'"{d.sign.text}"' in en and f"“{d.sign.text}”" in zh
        else:
            assert "sign" not in en and "牌子" not in zh


def test_groups_have_distinct_colours_and_positions_and_stay_in_their_cells() -> None:
    for scene in [draw_scene(6, i) for i in range(300)]:
        groups = scene.description.groups
        assert len({g.colour for g in groups}) == len(groups) == len({g.position for g in groups})
        assert sum(g.count for g in groups) == len(scene.objects)
        for obj in scene.objects:
            ax, ay = ANCHORS[obj.position]
            x0, y0, x1, y1 = obj.box
            assert ax - CELL_HALF - 1e-9 <= x0 < x1 <= ax + CELL_HALF + 1e-9
            assert ay - CELL_HALF - 1e-9 <= y0 < y1 <= ay + CELL_HALF + 1e-9


@pytest.mark.parametrize("size", [64, 256])
def test_ground_truth_matches_the_pixels(size: int) -> None:
    """Each object's colour is at its box centre; outside every box and the sign only background remains."""
    for scene in [draw_scene(7, i) for i in range(40)]:
        pixels = np.asarray(render(scene, size))
        truth = scene.truth(size)
        covered = np.zeros(pixels.shape[:2], dtype=bool)
        for obj in truth["objects"]:
            x0, y0, x1, y1 = obj["bbox"]
            assert tuple(pixels[(y0 + y1) // 2, (x0 + x1) // 2]) == COLOURS[obj["colour"]]
            assert (np.all(pixels[y0 : y1 + 1, x0 : x1 + 1] == COLOURS[obj["colour"]], axis=-1)).any()
            covered[y0 : y1 + 1, x0 : x1 + 1] = True
        if truth["sign"] is not None:
            x0, y0, x1, y1 = truth["sign"]["bbox"]
            covered[y0 : y1 + 1, x0 : x1 + 1] = True
        background = {packed(BACKGROUNDS[c]) for c in truth["background"]["colours"]}
        assert set(np.unique(packed(pixels[~covered])).tolist()) <= background


def test_pixel_boxes_scale_with_the_size() -> None:
    assert pixel_box((0.25, 0.5, 0.5, 0.75), 64) == (16, 32, 31, 47)
    assert pixel_box((0.25, 0.5, 0.5, 0.75), 256) == (64, 128, 127, 191)
