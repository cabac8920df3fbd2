"""Draw the built-in edit sets (`pipelines/edit_sets/`): input images from eval/scenes.py's drawn scenes
(coloured shapes at named positions, some stretched to other aspect ratios) and instructions written from
each scene's description, so an instruction names what its image shows.

    python -m qwen_image_fusion.eval.draw_edit_sets [--out DIR]  (default: pipelines/edit_sets, committed)

`edit` has one image per request (Edit and Plus checkpoints), `edit-plus` two or three (Plus). `img2img`
starts from `edit`'s images with their own captions (a rework at strength 0.6); `inpaint` masks each
image's first group of shapes (its boxes, with a margin) and asks for it in another colour (strength 0.9).
`control` guides a ControlNet checkpoint with each image's canny edges (made when it runs) and its caption;
`control-inpaint` gives an inpainting ControlNet `inpaint`'s images, masks and prompts, and `edit-inpaint`
gives them to an Edit checkpoint as inpainting edits (the image as its input image, with the mask).
The files are deterministic: tests/test_edit_sets.py draws them again and compares.
"""

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from qwen_image_fusion.eval.scenes import (
    BACKGROUNDS,
    COLOUR_ZH,
    COLOURS,
    POSITION_EN,
    SHAPE_NAMES,
    Description,
    Scene,
    caption_en,
    draw_scene,
    pixel_box,
    render,
)
from qwen_image_fusion.pipelines.requests import EDIT_SET_SUFFIX, EDIT_SETS_DIR

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


MASK_MARGIN = 0.04  # of each side, around the masked shapes' boxes


def first_group_mask(scene: Scene, size: tuple[int, int]) -> Image.Image:
    """White over the boxes (with a margin) of the objects of the scene's first group, at `size`."""
    first = scene.description.groups[0]
    mask = Image.new("L", size, 0)
    pen = ImageDraw.Draw(mask)
    for placed in scene.objects:
        if (placed.shape, placed.colour, placed.position) != (first.shape, first.colour, first.position):
            continue
        x0, y0, x1, y1 = placed.box
        box = (x0 - MASK_MARGIN, y0 - MASK_MARGIN, x1 + MASK_MARGIN, y1 + MASK_MARGIN)
        left, top, right, bottom = pixel_box(tuple(min(1.0, max(0.0, v)) for v in box), DRAW_SIDE)
        sx, sy = size[0] / DRAW_SIDE, size[1] / DRAW_SIDE
        pen.rectangle((round(left * sx), round(top * sy), round(right * sx), round(bottom * sy)), fill=255)
    return mask


def start_entries(out: Path, index: int, size: tuple[int, int], name: str) -> tuple[dict, dict]:
    """The `img2img` and `inpaint` requests starting from edit image `name` (scene `index` at `size`); the
    inpaint mask is drawn into `out/masks`."""
    scene = draw_scene(SEED, index)
    d = scene.description
    caption = caption_en(d, np.random.default_rng(index))
    mask_name = f"masks/mask-{index:02d}.png"
    first_group_mask(scene, size).save(out / mask_name)
    shape = SHAPE_NAMES[d.groups[0].shape][0].en
    colour = _other_colour(d)
    article = "an" if colour[0] in "aeiou" else "a"
    repaint = f"{article} {colour} {shape} {_where(d)}, {d.background.colours[0]} background"
    return (
        {"prompt": caption, "init_image": name, "strength": 0.6},
        {"prompt": repaint, "init_image": name, "mask": mask_name, "strength": 0.9},
    )


def write_sets(out: Path) -> dict[str, Path]:
    """Draw every image into `out/images` (masks into `out/masks`) and write each set's `.jsonl`; returns
    the sets."""
    for folder in ("images", "masks"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    index = 0
    sets: dict[str, list[dict]] = {
        "edit": [],
        "edit-plus": [],
        "img2img": [],
        "inpaint": [],
        "control": [],
        "control-inpaint": [],
        "edit-inpaint": [],
    }
    for size, instruction in SINGLE:
        image, description = draw(index, size)
        name = f"images/scene-{index:02d}.png"
        image.save(out / name)
        sets["edit"].append({"prompt": instruction(description), "images": [name]})
        img2img, inpaint = start_entries(out, index, size, name)
        sets["img2img"].append(img2img)
        sets["inpaint"].append(inpaint)
        sets["control"].append({"prompt": img2img["prompt"], "control": [name], "control_mode": "canny"})
        repaint = {"prompt": inpaint["prompt"], "control": [name], "control_mask": inpaint["mask"]}
        sets["control-inpaint"].append(repaint)
        inpaint_edit = {"prompt": inpaint["prompt"], "images": [name], "mask": inpaint["mask"]}
        sets["edit-inpaint"].append(inpaint_edit | {"strength": inpaint["strength"]})
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
