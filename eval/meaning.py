"""Does an image show what its scene description asks? Colour masks, regions and connected components.

For each group of a description (count, colour, shape, position) the checker classifies every pixel to
the nearest colour of the scene palette (object colours, backgrounds, sign plate; a pixel farther than
MAX_COLOUR_DISTANCE from all of them is no colour), finds the 4-connected blobs of the group's colour
that are at least MIN_BLOB_FRACTION of the image, and gives each blob to the position whose anchor is
nearest its centroid. Then:

- colour+position passes when blobs of that colour lie at the asked position and hold at least half of
  that colour's blob area (a scene's groups have distinct colours, so the colour must be *there*);
- count passes when exactly `count` blobs of that colour lie at the asked position;
- shape (reported, not a headline) passes when every such blob is nearest the asked shape's
  (extent, solidity) prototype, measured on large renders of each shape.

No learned model is involved. Image-level results need every group of the scene to pass.
"""

from dataclasses import dataclass
from functools import cache

import numpy as np
from PIL import Image
from skimage.measure import label, regionprops

from eval.scenes import (
    ANCHORS,
    BACKGROUNDS,
    COLOURS,
    SHAPES,
    SIGN_PLATE,
    Background,
    Description,
    PlacedObject,
    Scene,
    render,
)

MAX_COLOUR_DISTANCE = 90.0
MIN_BLOB_FRACTION = 0.0006  # a quarter of the smallest drawn shape (a star of side 0.085)
POSITION_SHARE = 0.5
PALETTE_NAMES = (*COLOURS, *BACKGROUNDS, "sign")
PALETTE = np.array([*COLOURS.values(), *BACKGROUNDS.values(), SIGN_PLATE], dtype=np.int32)
PROTOTYPE_SIZE = 200
CHECKS = ("colour_position", "count", "shape")


@dataclass(frozen=True)
class Blob:
    colour: str
    area: int
    centroid: tuple[float, float]  # x, y as fractions of the image side
    position: str
    extent: float
    solidity: float


@dataclass(frozen=True)
class GroupCheck:
    """The verdicts for one asked group, with what was measured."""

    colour: str
    position: str
    count: int
    shape: str
    colour_position: bool
    found: int
    count_ok: bool
    shape_ok: bool
    share_at_position: float


@dataclass(frozen=True)
class ImageCheck:
    groups: tuple[GroupCheck, ...]

    @property
    def colour_position(self) -> bool:
        return all(g.colour_position for g in self.groups)

    @property
    def count(self) -> bool:
        return all(g.count_ok for g in self.groups)

    @property
    def shape(self) -> bool:
        return all(g.shape_ok for g in self.groups)

    def as_dict(self) -> dict:
        return {
            "colour_position": self.colour_position,
            "count": self.count,
            "shape": self.shape,
            "groups": [vars(g) for g in self.groups],
        }


def classify_colours(pixels: np.ndarray) -> np.ndarray:
    """Palette index of every pixel of an (H, W, 3) uint8 image; -1 where no palette colour is close."""
    distance = ((pixels[:, :, None, :].astype(np.int32) - PALETTE) ** 2).sum(axis=-1)
    nearest = distance.argmin(axis=-1)
    return np.where(distance.min(axis=-1) <= MAX_COLOUR_DISTANCE**2, nearest, -1)


def nearest_position(x: float, y: float) -> str:
    return min(ANCHORS, key=lambda p: (ANCHORS[p][0] - x) ** 2 + (ANCHORS[p][1] - y) ** 2)


def find_blobs(classes: np.ndarray, colour: str) -> list[Blob]:
    """The 4-connected components of one colour that are large enough to be a drawn shape."""
    height, width = classes.shape
    min_area = MIN_BLOB_FRACTION * height * width
    labels = label(classes == PALETTE_NAMES.index(colour), connectivity=1)
    blobs = []
    for region in regionprops(labels):
        if region.area < min_area:
            continue
        cy, cx = region.centroid
        x, y = (cx + 0.5) / width, (cy + 0.5) / height
        blobs.append(
            Blob(colour, int(region.area), (x, y), nearest_position(x, y), region.extent, region.solidity)
        )
    return blobs


def shape_features(shape: str) -> tuple[float, float]:
    """(extent, solidity) of one shape drawn large on a plain background."""
    return _prototypes()[shape]


@cache
def _prototypes() -> dict[str, tuple[float, float]]:
    features = {}
    for shape in SHAPES:
        obj = PlacedObject(shape, "red", "centre", (0.2, 0.2, 0.8, 0.8))
        scene = Scene(Description((), Background(("white",))), (obj,), None, {})
        classes = classify_colours(np.asarray(render(scene, PROTOTYPE_SIZE)))
        (blob,) = find_blobs(classes, "red")
        features[shape] = (blob.extent, blob.solidity)
    return features


def nearest_shape(blob: Blob) -> str:
    prototypes = _prototypes()
    return min(
        prototypes,
        key=lambda s: (prototypes[s][0] - blob.extent) ** 2 + (prototypes[s][1] - blob.solidity) ** 2,
    )


def check_image(image: Image.Image | np.ndarray, description: Description) -> ImageCheck:
    """Every asked group of `description` measured on `image` (RGB, any square size)."""
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
    classes = classify_colours(pixels)
    checks = []
    for group in description.groups:
        blobs = find_blobs(classes, group.colour)
        here = [b for b in blobs if b.position == group.position]
        total = sum(b.area for b in blobs)
        share = sum(b.area for b in here) / total if total else 0.0
        checks.append(
            GroupCheck(
                colour=group.colour,
                position=group.position,
                count=group.count,
                shape=group.shape,
                colour_position=bool(here) and share >= POSITION_SHARE,
                found=len(here),
                count_ok=len(here) == group.count,
                shape_ok=bool(here) and all(nearest_shape(b) == group.shape for b in here),
                share_at_position=share,
            )
        )
    return ImageCheck(tuple(checks))


def accuracy(checks: list[ImageCheck]) -> dict[str, float]:
    """Share of images passing each test (every group of the image must pass), and of groups."""
    if not checks:
        return {}
    groups = [g for c in checks for g in c.groups]
    return {
        "images": len(checks),
        "colour_position": float(np.mean([c.colour_position for c in checks])),
        "count": float(np.mean([c.count for c in checks])),
        "shape": float(np.mean([c.shape for c in checks])),
        "groups": len(groups),
        "group_colour_position": float(np.mean([g.colour_position for g in groups])),
        "group_count": float(np.mean([g.count_ok for g in groups])),
    }


def shuffled_baseline(images: list[np.ndarray], descriptions: list[Description]) -> dict[str, float]:
    """Accuracy when each image is checked against the next scene's description: the chance level of
    these images, measured instead of assumed."""
    n = len(images)
    return accuracy([check_image(images[i], descriptions[(i + 1) % n]) for i in range(n)])
