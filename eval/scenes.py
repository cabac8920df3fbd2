"""Scenes drawn with Pillow: coloured shapes at named positions, captioned in English and Chinese.

A scene is drawn from `(seed, index)` alone (numpy `Generator`s seeded per scene, no global RNG state),
so any worker process can draw scene i of a stream. Its `Description` is what the captions say: one to
three groups of 1-3 identical shapes (each group one colour at one of five positions), a plain or
two-colour background and an optional sign with a short word. Layout (sizes, offsets) is drawn in
fractions of the image side, so one scene renders at any size, with its ground truth in pixels.

Held-out split: a description's *object key* (its groups, sorted) is hashed; keys in the held-out
bucket are never drawn for training (`draw_scene` redraws them) and are the only ones `held_out_scenes`
returns. Every caption states every group, so a training caption never describes held-out objects: the
held-out captions are unseen in training whatever their background, sign or paraphrase, and even the
object composition they describe never appears in training with any background or sign.
"""

import hashlib
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

RGB = tuple[int, int, int]
Box = tuple[float, float, float, float]  # x0, y0, x1, y1 as fractions of the image side


@dataclass(frozen=True)
class Name:
    """A word of the scene vocabulary in both caption languages."""

    en: str
    zh: str


COLOURS: dict[str, RGB] = {
    "red": (215, 35, 35),
    "orange": (245, 140, 20),
    "yellow": (245, 215, 30),
    "green": (40, 165, 60),
    "cyan": (30, 200, 210),
    "blue": (35, 75, 215),
    "purple": (135, 55, 185),
    "pink": (245, 125, 185),
}
COLOUR_ZH = {
    "red": "红色",
    "orange": "橙色",
    "yellow": "黄色",
    "green": "绿色",
    "cyan": "青色",
    "blue": "蓝色",
    "purple": "紫色",
    "pink": "粉色",
}
BACKGROUNDS: dict[str, RGB] = {
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "gray": (128, 128, 128),
    "beige": (225, 210, 170),
}
BACKGROUND_ZH = {"white": "白色", "black": "黑色", "gray": "灰色", "beige": "米色"}
SIGN_PLATE: RGB = (120, 75, 40)
SIGN_LETTERS: RGB = (255, 255, 255)
SHAPES = ("circle", "square", "triangle", "star", "cross")
SHAPE_NAMES = {
    "circle": (Name("circle", "圆形"), "circles"),
    "square": (Name("square", "正方形"), "squares"),
    "triangle": (Name("triangle", "三角形"), "triangles"),
    "star": (Name("star", "星星"), "stars"),
    "cross": (Name("cross", "十字"), "crosses"),
}
POSITIONS = ("left", "right", "top", "bottom", "centre")
ANCHORS: dict[str, tuple[float, float]] = {
    "left": (0.2, 0.5),
    "right": (0.8, 0.5),
    "top": (0.5, 0.2),
    "bottom": (0.5, 0.8),
    "centre": (0.5, 0.5),
}
CELL_HALF = 0.15  # each position owns the 0.3 x 0.3 cell around its anchor; the five cells do not overlap
POSITION_EN = {
    "left": ("on the left", "at the left", "on the left side"),
    "right": ("on the right", "at the right", "on the right side"),
    "top": ("at the top", "near the top", "at the top of the picture"),
    "bottom": ("at the bottom", "near the bottom", "at the bottom of the picture"),
    "centre": ("in the centre", "in the middle", "in the center"),
}
POSITION_ZH = {
    "left": ("左边", "左侧"),
    "right": ("右边", "右侧"),
    "top": ("上方", "顶部"),
    "bottom": ("下方", "底部"),
    "centre": ("中间", "中央"),
}
COUNT_EN = {2: "two", 3: "three"}
COUNT_ZH = {1: "一", 2: "两", 3: "三"}
SIGN_WORDS = (
    "OPEN",
    "STOP",
    "HELLO",
    "CAFE",
    "SALE",
    "EXIT",
    "SHOP",
    "QWEN",
    "HOTEL",
    "BOOKS",
    "TAXI",
    "ZOO",
)
SIGN_POSITIONS = ("top", "bottom")  # a sign is wide: only the top and bottom bands have room for it
GROUP_COUNT_WEIGHTS = (0.35, 0.45, 0.2)  # scenes with 1, 2, 3 groups
OBJECT_COUNT_WEIGHTS = (0.5, 0.25, 0.25)  # groups of 1, 2, 3 shapes
SIGN_PROBABILITY = 0.25
TWO_COLOUR_BACKGROUND_PROBABILITY = 0.3
MIN_GAP = 0.05  # between shapes of one group, so they stay separate blobs at 64 px
HELD_OUT_PERCENT = 2
HELD_OUT_SEED = 15_000_015
LANGUAGES = ("en", "zh")


@dataclass(frozen=True)
class Group:
    """`count` shapes of one kind and colour at one named position."""

    count: int
    colour: str
    shape: str
    position: str


@dataclass(frozen=True)
class Background:
    """One colour, or two split down the middle: `split` is plain, vertical (left|right) or horizontal."""

    colours: tuple[str, ...]
    split: str = "plain"


@dataclass(frozen=True)
class Sign:
    text: str
    position: str


@dataclass(frozen=True)
class Description:
    """What a scene shows, in words: the content its captions state and the checker tests."""

    groups: tuple[Group, ...]
    background: Background
    sign: Sign | None = None

    def object_key(self) -> str:
        """Canonical text of the groups (order-free): the unit of the held-out split."""
        return "|".join(sorted(f"{g.count} {g.colour} {g.shape} {g.position}" for g in self.groups))

    def is_held_out(self) -> bool:
        digest = hashlib.sha256(self.object_key().encode()).digest()
        return int.from_bytes(digest[:8], "little") % 100 < HELD_OUT_PERCENT


@dataclass(frozen=True)
class PlacedObject:
    """One drawn shape; `box` in fractions of the image side."""

    shape: str
    colour: str
    position: str
    box: Box


@dataclass(frozen=True)
class Scene:
    """A description, its layout and its two captions, all drawn from one seed."""

    description: Description
    objects: tuple[PlacedObject, ...]
    sign_box: Box | None
    captions: dict[str, str] = field(compare=False)
    seed: tuple[int, ...] = ()

    def truth(self, size: int) -> dict[str, Any]:
        """Ground truth at `size` px: objects (shape, colour, position, pixel bbox), background, sign."""
        d = self.description
        return {
            "objects": [
                {"shape": o.shape, "colour": o.colour, "position": o.position, "bbox": pixel_box(o.box, size)}
                for o in self.objects
            ],
            "groups": [vars(g) for g in d.groups],
            "background": {"colours": list(d.background.colours), "split": d.background.split},
            "sign": None
            if d.sign is None
            else {"text": d.sign.text, "position": d.sign.position, "bbox": pixel_box(self.sign_box, size)},
            "captions": dict(self.captions),
        }


def pick(rng: np.random.Generator, options: tuple | list) -> Any:
    """One element of `options`, uniformly."""
    return options[int(rng.integers(len(options)))]


def pick_weighted(rng: np.random.Generator, weights: tuple[float, ...]) -> int:
    """An index drawn with the given probabilities."""
    return int(rng.choice(len(weights), p=np.asarray(weights) / sum(weights)))


def sample_description(rng: np.random.Generator) -> Description:
    """Groups at distinct positions in distinct colours, a background, maybe a sign on a free band."""
    n_groups = 1 + pick_weighted(rng, GROUP_COUNT_WEIGHTS)
    positions = rng.permutation(len(POSITIONS))[:n_groups]
    colours = rng.permutation(len(COLOURS))[:n_groups]
    groups = tuple(
        Group(
            count=1 + pick_weighted(rng, OBJECT_COUNT_WEIGHTS),
            colour=list(COLOURS)[int(c)],
            shape=pick(rng, SHAPES),
            position=POSITIONS[int(p)],
        )
        for p, c in zip(positions, colours, strict=True)
    )
    if rng.random() < TWO_COLOUR_BACKGROUND_PROBABILITY:
        pair = rng.permutation(len(BACKGROUNDS))[:2]
        background = Background(
            tuple(list(BACKGROUNDS)[int(i)] for i in pair), pick(rng, ("vertical", "horizontal"))
        )
    else:
        background = Background((pick(rng, list(BACKGROUNDS)),))
    free = [p for p in SIGN_POSITIONS if p not in {g.position for g in groups}]
    sign = None
    if free and rng.random() < SIGN_PROBABILITY:
        sign = Sign(pick(rng, SIGN_WORDS), pick(rng, free))
    return Description(groups, background, sign)


def layout_group(group: Group, rng: np.random.Generator) -> list[PlacedObject]:
    """Boxes of a group's shapes inside its position's cell, apart by at least MIN_GAP."""
    ax, ay = ANCHORS[group.position]
    x0, y0 = ax - CELL_HALF, ay - CELL_HALF
    cell = 2 * CELL_HALF
    if group.count == 1:
        side = rng.uniform(0.17, 0.25)
        offsets = [(0.0, 0.0)]
        extent = (side, side)
    elif group.count == 2:
        side, gap = rng.uniform(0.10, 0.12), rng.uniform(MIN_GAP, 0.06)
        offsets = [(0.0, 0.0), (side + gap, 0.0)]
        extent = (2 * side + gap, side)
        if rng.random() < 0.5:  # stacked instead of side by side
            offsets = [(y, x) for x, y in offsets]
            extent = extent[::-1]
    else:
        side, gap = rng.uniform(0.085, 0.105), rng.uniform(MIN_GAP, 0.065)
        apex = ((side + gap) / 2, 0.0)
        base = [(0.0, side + gap), (side + gap, side + gap)]
        offsets = [apex, *base]
        if rng.random() < 0.5:  # apex at the bottom
            offsets = [(x, side + gap - y) for x, y in offsets]
        extent = (2 * side + gap, 2 * side + gap)
    left = x0 + rng.uniform(0.0, cell - extent[0])
    top = y0 + rng.uniform(0.0, cell - extent[1])
    return [
        PlacedObject(
            group.shape,
            group.colour,
            group.position,
            (left + dx, top + dy, left + dx + side, top + dy + side),
        )
        for dx, dy in offsets
    ]


def layout_sign(sign: Sign, rng: np.random.Generator) -> Box:
    """A plate across the top or bottom band, wide enough for its word."""
    width = min(0.8, 0.16 + 0.085 * len(sign.text)) * rng.uniform(0.95, 1.05)
    height = rng.uniform(0.15, 0.19)
    cx = 0.5 + rng.uniform(-0.05, 0.05)
    cy = ANCHORS[sign.position][1] + rng.uniform(-0.02, 0.02)
    return (cx - width / 2, cy - height / 2, cx + width / 2, cy + height / 2)


def count_phrase_en(group: Group, rng: np.random.Generator) -> str:
    name, plural = SHAPE_NAMES[group.shape]
    if group.count > 1:
        return f"{COUNT_EN[group.count]} {group.colour} {plural}"
    article = pick(rng, ("a", "one"))
    if article == "a" and group.colour[0] in "aeiou":
        article = "an"
    return f"{article} {group.colour} {name.en}"


def caption_en(description: Description, rng: np.random.Generator) -> str:
    """An English caption stating every group, the background and the sign, with paraphrase."""
    groups = [description.groups[int(i)] for i in rng.permutation(len(description.groups))]
    parts = [f"{count_phrase_en(g, rng)} {pick(rng, POSITION_EN[g.position])}" for g in groups]
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    bg = description.background
    if bg.split == "plain":
        text += pick(rng, (f" on a {bg.colours[0]} background", f", {bg.colours[0]} background"))
    else:
        a, b = bg.colours
        halves = (
            ("on the left", "on the right") if bg.split == "vertical" else ("at the top", "at the bottom")
        )
        text += f" on a background that is {a} {halves[0]} and {b} {halves[1]}"
    if description.sign is not None:
        sign = description.sign
        where = pick(rng, POSITION_EN[sign.position])
        text += pick(
            rng,
            (f', and a sign that says "{sign.text}" {where}', f', with a sign reading "{sign.text}" {where}'),
        )
    return pick(rng, ("", "a picture of ", "an image of ")) + text


def caption_zh(description: Description, rng: np.random.Generator) -> str:
    """The Chinese caption of the same description (same content, its own paraphrase)."""
    groups = [description.groups[int(i)] for i in rng.permutation(len(description.groups))]
    parts = []
    for g in groups:
        measure = "颗" if g.shape == "star" else "个"
        link = pick(rng, ("的", ""))
        parts.append(
            f"{pick(rng, POSITION_ZH[g.position])}有{COUNT_ZH[g.count]}{measure}{COLOUR_ZH[g.colour]}{link}"
            f"{SHAPE_NAMES[g.shape][0].zh}"
        )
    text = "，".join(parts)
    bg = description.background
    if bg.split == "plain":
        colour = BACKGROUND_ZH[bg.colours[0]]
        text += pick(rng, (f"，{colour}背景", f"，背景是{colour}的"))
    else:
        a, b = (BACKGROUND_ZH[c] for c in bg.colours)
        halves = ("左半边", "右半边") if bg.split == "vertical" else ("上半部分", "下半部分")
        text += f"，背景{halves[0]}是{a}、{halves[1]}是{b}"
    if description.sign is not None:
        sign = description.sign
        text += f"，{pick(rng, POSITION_ZH[sign.position])}有一块写着“{sign.text}”的牌子"
    return pick(rng, ("", "画面中")) + text + "。"


CAPTIONERS = {"en": caption_en, "zh": caption_zh}


def build_scene(
    rng: np.random.Generator, description: Description | None = None, seed: tuple[int, ...] = ()
) -> Scene:
    """Layout and captions of `description` (drawn from `rng` when None)."""
    description = description or sample_description(rng)
    objects = tuple(o for g in description.groups for o in layout_group(g, rng))
    sign_box = None if description.sign is None else layout_sign(description.sign, rng)
    captions = {language: CAPTIONERS[language](description, rng) for language in LANGUAGES}
    return Scene(description, objects, sign_box, captions, seed)


def draw_scene(seed: int, index: int) -> Scene:
    """Training scene `index` of the stream `seed`: never one of the held-out object keys."""
    for attempt in range(1000):
        rng = np.random.default_rng([seed, index, attempt])
        description = sample_description(rng)
        if not description.is_held_out():
            return build_scene(rng, description, (seed, index, attempt))
    raise RuntimeError(f"no training scene for seed {seed} index {index}")  # p = 0.02**1000


def held_out_scenes(count: int = 100) -> list[Scene]:
    """The first `count` distinct descriptions of the held-out stream whose object key is held out."""
    scenes: list[Scene] = []
    seen: set[Description] = set()
    index = 0
    while len(scenes) < count:
        rng = np.random.default_rng([HELD_OUT_SEED, index])
        description = sample_description(rng)
        if description.is_held_out() and description not in seen:
            seen.add(description)
            scenes.append(build_scene(rng, description, (HELD_OUT_SEED, index)))
        index += 1
    return scenes


def pixel_box(box: Box, size: int) -> tuple[int, int, int, int]:
    """Fractions -> inclusive integer pixel corners, as Pillow draws them."""
    x0, y0, x1, y1 = box
    return round(x0 * size), round(y0 * size), round(x1 * size) - 1, round(y1 * size) - 1


def shape_polygon(shape: str, box: tuple[int, int, int, int]) -> list[tuple[float, float]]:
    """Vertices of the polygonal shapes inside an integer pixel box."""
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "triangle":
        return [(cx, y0), (x1, y1), (x0, y1)]
    if shape == "cross":
        a, b = w / 3, h / 3
        xs, ys = (x0, x0 + a, x1 - a, x1), (y0, y0 + b, y1 - b, y1)
        return [
            (xs[1], ys[0]), (xs[2], ys[0]), (xs[2], ys[1]), (xs[3], ys[1]), (xs[3], ys[2]), (xs[2], ys[2]),
            (xs[2], ys[3]), (xs[1], ys[3]), (xs[1], ys[2]), (xs[0], ys[2]), (xs[0], ys[1]), (xs[1], ys[1]),
        ]  # fmt: skip
    if shape == "star":
        angles = -np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, 1.0, 0.45)
        # the outer points span 1.90 r across and 1.81 r down: scale and centre them in the box
        px, py = radii * np.cos(angles), radii * np.sin(angles)
        scale = min(w / (px.max() - px.min()), h / (py.max() - py.min()))
        oy = cy - scale * (py.max() + py.min()) / 2
        return [(cx + scale * x, oy + scale * y) for x, y in zip(px, py, strict=True)]
    raise ValueError(f"not a polygon shape: {shape}")


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill: RGB) -> None:
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon(shape_polygon(shape, box), fill=fill)


@cache
def sign_font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's bundled font at `size` px (the same glyphs on every machine with this Pillow); a Pillow
    without FreeType (or older than 10.1) has only its fixed-size bitmap font."""
    try:
        return ImageFont.load_default(size=size)
    except (ImportError, TypeError):
        return ImageFont.load_default()


def draw_sign(draw: ImageDraw.ImageDraw, text: str, box: tuple[int, int, int, int]) -> None:
    """A plate with its word centred, in the largest font size that fits."""
    draw.rectangle(box, fill=SIGN_PLATE)
    x0, y0, x1, y1 = box
    size = max(4, round(0.7 * (y1 - y0)))
    while size > 4:
        left, top, right, bottom = draw.textbbox((0, 0), text, font=sign_font(size))
        if right - left <= 0.88 * (x1 - x0) and bottom - top <= 0.75 * (y1 - y0):
            break
        size -= 1
    draw.text(((x0 + x1) / 2, (y0 + y1) / 2), text, fill=SIGN_LETTERS, font=sign_font(size), anchor="mm")


def render(scene: Scene, size: int) -> Image.Image:
    """The scene as a `size` x `size` RGB image: background, sign, then the shapes."""
    background = scene.description.background
    image = Image.new("RGB", (size, size), BACKGROUNDS[background.colours[0]])
    draw = ImageDraw.Draw(image)
    if background.split == "vertical":
        draw.rectangle((size // 2, 0, size - 1, size - 1), fill=BACKGROUNDS[background.colours[1]])
    elif background.split == "horizontal":
        draw.rectangle((0, size // 2, size - 1, size - 1), fill=BACKGROUNDS[background.colours[1]])
    if scene.description.sign is not None:
        draw_sign(draw, scene.description.sign.text, pixel_box(scene.sign_box, size))
    for obj in scene.objects:
        draw_shape(draw, obj.shape, pixel_box(obj.box, size), COLOURS[obj.colour])
    return image


def render_batch(seed: int, indices: range, size: int) -> np.ndarray:
    """Training scenes `indices` of stream `seed` as uint8 [N, size, size, 3] (for worker processes)."""
    out = np.empty((len(indices), size, size, 3), dtype=np.uint8)
    for row, index in enumerate(indices):
        out[row] = np.asarray(render(draw_scene(seed, index), size))
    return out
