"""Draw the built-in edit sets (`pipelines/edit_sets/`): input images from eval/scenes.py's drawn scenes
(coloured shapes at named positions, some stretched to other aspect ratios) and instructions written from
each scene's description, so an instruction names what its image shows.

    python -m eval.draw_edit_sets [--out DIR]     (default: pipelines/edit_sets, the committed files)

`edit` has one image per request (Edit and Plus checkpoints), `edit-plus` two or three (Plus). The files
are deterministic: tests/test_edit_sets.py draws them again and compares.
"""

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from eval.scenes import (
    BACKGROUNDS,
    COLOUR_ZH,
    COLOURS,
    POSITION_EN,
    SHAPE_NAMES,
    Description,
    draw_scene,
    render,
)
from pipelines.requests import EDIT_SET_SUFFIX, EDIT_SETS_DIR

SEED = 22_022  # the scene stream of the edit sets (issue 22)
DRAW_SIDE = 512  # scenes are drawn square at this side, then resized to each request's size


def _group(d: Description, i: int = 0) -> str:
    g = d.groups[i % len(d.groups)]
    name, plural = SHAPE_NAMES[g.shape]
    return f"{g.colour} {name.en if g.count == 1 else plural}"


def _where(d: Description, i: int = 0) -> str:
    return POSITION_EN[d.groups[i % len(d.groups)].position][0]


def _other_colour(d: Description) -> str:
    used = {g.colour for g in d.groups}
    return next(c for c in COLOURS if c not in used)


def _other_background(d: Description) -> str:
    return next(b for b in BACKGROUNDS if b not in d.background.colours)


# One image per request: (size, instruction from the scene's description)
SINGLE: list[tuple[tuple[int, int], Callable[[Description], str]]] = [
    ((512, 512), lambda d: f"Change the {_group(d)} {_where(d)} to {_other_colour(d)}."),
    ((640, 384), lambda d: f"Remove the {_group(d)} {_where(d)} and keep everything else."),
    ((384, 576), lambda d: f"Make the background {_other_background(d)}."),
    ((768, 512), lambda d: f"Add a small {_other_colour(d)} star in the top left corner."),
    (
        (448, 448),
        lambda d: (
            f"把{COLOUR_ZH[d.groups[0].colour]}的{SHAPE_NAMES[d.groups[0].shape][0].zh}变成"
            f"{COLOUR_ZH[_other_colour(d)]}。"
        ),
    ),
    ((512, 640), lambda d: f"Move the {_group(d)} to the centre and make it twice as large."),
]
# Several images per request: (sizes, instruction from the scenes' descriptions)
MULTI: list[tuple[tuple[tuple[int, int], ...], Callable[[list[Description]], str]]] = [
    (
        ((512, 512), (640, 448)),
        lambda ds: f"Put the {_group(ds[0])} from picture 1 next to the {_group(ds[1])} in picture 2.",
    ),
    (((448, 576), (576, 448)), lambda ds: "Draw the shapes of picture 1 on the background of picture 2."),
    (
        ((384, 384), (512, 384), (384, 512)),
        lambda ds: (
            f"Place the {_group(ds[0])} of picture 1, the {_group(ds[1])} of picture 2 and the "
            f"{_group(ds[2])} of picture 3 in one row on a white background."
        ),
    ),
]


def draw(index: int, size: tuple[int, int]) -> tuple[Image.Image, Description]:
    """Scene `index` of the edit sets' stream at `size`, and its description."""
    scene = draw_scene(SEED, index)
    image = render(scene, DRAW_SIDE)
    if size != (DRAW_SIDE, DRAW_SIDE):
        image = image.resize(size, Image.Resampling.LANCZOS)
    return image, scene.description


def write_sets(out: Path) -> dict[str, Path]:
    """Draw every image into `out/images` and write `edit.jsonl` and `edit-plus.jsonl`; returns the sets."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    index = 0
    sets: dict[str, list[dict]] = {"edit": [], "edit-plus": []}
    for size, instruction in SINGLE:
        image, description = draw(index, size)
        name = f"images/scene-{index:02d}.png"
        image.save(out / name)
        sets["edit"].append({"prompt": instruction(description), "images": [name]})
        index += 1
    for sizes, instruction in MULTI:
        names, descriptions = [], []
        for size in sizes:
            image, description = draw(index, size)
            names.append(f"images/scene-{index:02d}.png")
            image.save(out / names[-1])
            descriptions.append(description)
            index += 1
        sets["edit-plus"].append({"prompt": instruction(descriptions), "images": names})
    paths = {}
    for name, entries in sets.items():
        paths[name] = out / f"{name}{EDIT_SET_SUFFIX}"
        paths[name].write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries), "utf-8")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=EDIT_SETS_DIR)
    args = parser.parse_args()
    for name, path in write_sets(args.out).items():
        print(f"wrote {path} ({sum(1 for _ in path.open(encoding='utf-8'))} requests, set {name!r})")


if __name__ == "__main__":
    main()
