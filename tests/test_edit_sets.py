"""The built-in edit sets: drawn by the project (eval/draw_edit_sets.py, from eval/scenes.py), so drawing them
again gives the committed files; they parse into requests Edit and Plus checkpoints can run; a malformed
edit set is refused in one line naming the file and the line."""

import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from qwen_image_fusion.eval.draw_edit_sets import write_sets
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines.requests import (
    BUILTIN_EDIT_SETS,
    EDIT_SETS_DIR,
    Request,
    builtin_edit_set,
    check_requests,
    edit_requests_for,
    read_requests,
)


def test_committed_sets_are_what_the_script_draws(tmp_path: Path) -> None:
    written = write_sets(tmp_path)
    assert sorted(written) == sorted(BUILTIN_EDIT_SETS)
    for name, path in written.items():
        assert path.read_text("utf-8") == (EDIT_SETS_DIR / path.name).read_text("utf-8"), name
    drawn = sorted([*(tmp_path / "images").iterdir(), *(tmp_path / "masks").iterdir()])
    committed = sorted([*(EDIT_SETS_DIR / "images").iterdir(), *(EDIT_SETS_DIR / "masks").iterdir()])
    assert [p.name for p in drawn] == [p.name for p in committed]
    for new, old in zip(drawn, committed, strict=True):
        assert np.array_equal(np.asarray(PIL.Image.open(new)), np.asarray(PIL.Image.open(old))), new.name


def test_builtin_sets_fit_edit_and_plus() -> None:
    single, multi = builtin_edit_set("edit"), builtin_edit_set("edit-plus")
    assert len(single) == 6 and all(len(r.images) == 1 for r in single)
    assert sorted(len(r.images) for r in multi) == [2, 2, 3]
    sizes = {PIL.Image.open(path).size for r in single + multi for path in r.images}
    assert len(sizes) > 5 and any(w != h for w, h in sizes)  # several aspect ratios
    assert any(not r.prompt.isascii() for r in single)  # a Chinese instruction
    check_requests(edit_requests_for(1), 1, True, "edit")
    check_requests(edit_requests_for(3), 3, True, "plus")
    assert edit_requests_for(1) == single and edit_requests_for(3) == single + multi


def test_requests_a_model_cannot_take_are_refused_naming_the_request() -> None:
    with pytest.raises(
        InputError, match=r"request 1 \('Put the .*'\): 2 input images, but edit takes at most 1"
    ):
        check_requests(builtin_edit_set("edit-plus"), 1, True, "edit")
    with pytest.raises(InputError, match=r"request 1 \('a fox'\): text2img works on input images"):
        check_requests([Request("a fox")], 3, True, "text2img")
    with pytest.raises(InputError, match="generates from text only"):
        check_requests(builtin_edit_set("edit"), 0, False, "t2i")
    with pytest.raises(InputError, match=r"request 1 .*: edit does not start from an image"):
        check_requests(builtin_edit_set("inpaint"), 1, True, "edit")


def test_start_sets_rework_and_inpaint_the_edit_images() -> None:
    """img2img starts from each edit image at 0.6; inpaint masks a part of it (its first group of shapes)
    at 0.9; each mask has its image's size."""
    edit, img2img, inpaint = (builtin_edit_set(name) for name in ("edit", "img2img", "inpaint"))
    assert [r.init_image for r in img2img] == [r.init_image for r in inpaint] == [r.images[0] for r in edit]
    assert {r.strength for r in img2img} == {0.6} and {r.strength for r in inpaint} == {0.9}
    for request in inpaint:
        mask = np.asarray(PIL.Image.open(request.mask))
        assert PIL.Image.open(request.init_image).size == mask.shape[::-1]
        assert 0.02 < (mask > 127).mean() < 0.3
    check_requests(img2img + inpaint, 0, False, "qwen-image", starts=True)


def test_control_sets_guide_by_the_edit_images() -> None:
    """`control` reads each edit image as a photo whose canny edges guide a ControlNet, with img2img's
    captions (only a model with a ControlNet takes it); `control-inpaint` gives an inpainting ControlNet
    `inpaint`'s images, masks and prompts."""
    edit, img2img, control = (builtin_edit_set(name) for name in ("edit", "img2img", "control"))
    assert [r.control for r in control] == [r.images for r in edit]
    assert [r.prompt for r in control] == [r.prompt for r in img2img]
    assert {r.control_mode for r in control} == {"canny"} and {r.control_scale for r in control} == {None}
    check_requests(control, 0, False, "qwen-image-controlnet", starts=True, controls=True)
    with pytest.raises(InputError, match=r"request 1 .*: qwen-image holds no ControlNet"):
        check_requests(control, 0, False, "qwen-image", starts=True)
    repaint = builtin_edit_set("control-inpaint")
    inpaint = builtin_edit_set("inpaint")
    assert [(r.control[0], r.control_mask, r.prompt) for r in repaint] == [
        (r.init_image, r.mask, r.prompt) for r in inpaint
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2 is not JSON"),
        (json.dumps({"images": ["a.png"]}), 'line 2 needs a non-empty "prompt" string'),
        (json.dumps({"prompt": "x", "images": []}), 'line 2 needs "images": a non-empty list of file names'),
        (
            json.dumps({"prompt": "x", "images": ["missing.png"]}),
            "line 2: image .*missing.png does not exist",
        ),
        (json.dumps({"prompt": "x", "mask": "a.png", "images": ["a.png", "a.png"]}), "needs the .init_image"),
        (json.dumps({"prompt": "x", "init_image": "a.png", "strength": "hi"}), '"strength" must be a number'),
        (json.dumps({"prompt": "x", "init_image": 3}), '"init_image" must be a file name'),
        (json.dumps({"prompt": "x", "init_image": "a.png", "mask": "m.png"}), "image .*m.png does not exist"),
    ],
)
def test_malformed_edit_sets_are_refused_in_one_line(tmp_path: Path, line: str, message: str) -> None:
    PIL.Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "images": ["a.png"]}) + "\n" + line + "\n")
    with pytest.raises(InputError, match=message):
        read_requests(path)


def test_prompt_files_are_text_requests(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("# comment\na fox\n\na boat\n")
    assert read_requests(path) == [Request("a fox"), Request("a boat")]
