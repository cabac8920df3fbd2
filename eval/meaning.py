"""Does an image show what its scene description asks? Colour masks, regions and connected components.

    python -m qwen_image_fusion.eval.meaning --model DIR --out out/meaning  # 100 held-out scenes, EN and ZH
    python -m qwen_image_fusion.eval.meaning --model DIR --fp8 --out out/fp8  # FP8 (quantized) vs BF16
    python -m qwen_image_fusion.eval.meaning --truth                      # the checker on the true drawings

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

import argparse
import datetime
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image
from skimage.measure import label, regionprops
from tqdm.auto import tqdm

from qwen_image_fusion.eval import metrics
from qwen_image_fusion.eval.report import write_json
from qwen_image_fusion.eval.scenes import (
    ANCHORS,
    BACKGROUNDS,
    COLOURS,
    HELD_OUT_PERCENT,
    HELD_OUT_SEED,
    LANGUAGES,
    SHAPES,
    SIGN_PLATE,
    Background,
    Description,
    PlacedObject,
    Scene,
    draw_scene,
    held_out_scenes,
    render,
)
from qwen_image_fusion.models.cache_presets import get_cache_preset
from qwen_image_fusion.models.errors import InputError, QwenImageError

if TYPE_CHECKING:
    from qwen_image_fusion.pipelines.run_info import CacheReport

MAX_COLOUR_DISTANCE = 90.0
MIN_BLOB_FRACTION = 0.0006  # a quarter of the smallest drawn shape (a star of side 0.085)
POSITION_SHARE = 0.5
PALETTE_NAMES = (*COLOURS, *BACKGROUNDS, "sign")
PALETTE = np.array([*COLOURS.values(), *BACKGROUNDS.values(), SIGN_PLATE], dtype=np.int32)
PROTOTYPE_SIZE = 200
CALIBRATION_SEED = 7


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


# ---------------------------------------------------------------- the held-out report and its CLI


@dataclass(frozen=True)
class EvalSettings:
    """How the held-out images are generated."""

    size: int = 256
    steps: int = 20
    negative_prompt: str | None = " "
    true_cfg_scale: float = 4.0
    seed: int = 0
    languages: tuple[str, ...] = LANGUAGES


def generate_held_out(
    pipe, scenes: list[Scene], settings: EvalSettings, desc: str, cache: str | None = None
) -> tuple[dict[str, list[np.ndarray]], list[str]]:
    """One image per scene and language; scene i uses seed `settings.seed + i` in every language; `cache`
    a step-cache preset. Also each run's step-cache line (RunInfo.cache)."""
    images: dict[str, list[np.ndarray]] = {language: [] for language in settings.languages}
    runs: list[CacheReport] = []
    jobs = [(language, i, scene) for language in settings.languages for i, scene in enumerate(scenes)]
    for language, i, scene in tqdm(jobs, desc=desc, file=sys.stderr):
        image = pipe.generate(
            scene.captions[language],
            negative_prompt=settings.negative_prompt,
            width=settings.size,
            height=settings.size,
            num_inference_steps=settings.steps,
            true_cfg_scale=settings.true_cfg_scale,
            seed=settings.seed + i,
            cache=cache,
        )[0]
        images[language].append(np.asarray(image.convert("RGB")))
        runs.append(pipe.last_run.cache)
    return images, runs


def score(images: dict[str, list[np.ndarray]], scenes: list[Scene]) -> dict:
    """Accuracy per language and over both, the shuffled-description chance level, and per-scene rows."""
    descriptions = [s.description for s in scenes]
    checks = {
        lang: [check_image(img, d) for img, d in zip(imgs, descriptions, strict=True)]
        for lang, imgs in images.items()
    }
    everything = [c for lang_checks in checks.values() for c in lang_checks]
    return {
        "accuracy": {**{lang: accuracy(c) for lang, c in checks.items()}, "all": accuracy(everything)},
        "chance": {lang: shuffled_baseline(imgs, descriptions) for lang, imgs in images.items()},
        "scenes": [
            {
                "index": i,
                "object_key": scene.description.object_key(),
                "captions": {lang: scene.captions[lang] for lang in images},
                "checks": {lang: checks[lang][i].as_dict() for lang in images},
            }
            for i, scene in enumerate(scenes)
        ],
    }


def calibration_prompts(count: int) -> list[str]:
    """Training-stream captions (never held out) for FP8 calibration, English and Chinese."""
    scenes = [draw_scene(CALIBRATION_SEED, i) for i in range(count)]
    return [s.captions[lang] for s in scenes for lang in LANGUAGES]


def image_pair_metrics(a: dict[str, list[np.ndarray]], b: dict[str, list[np.ndarray]]) -> dict:
    """PSNR and SSIM (qwen_image_fusion.eval.metrics) of every image pair, with their min / median / mean /
    max."""
    psnrs, ssims = [], []
    for lang in a:
        for x, y in zip(a[lang], b[lang], strict=True):
            psnrs.append(metrics.psnr(x, y))
            ssims.append(metrics.ssim(x, y))

    def spread(values: list[float]) -> dict:
        finite = [v for v in values if np.isfinite(v)]
        return {
            "min": min(values),
            "median": float(np.median(values)),
            "mean_finite": float(np.mean(finite)) if finite else None,
            "max": max(values),
            "identical": len(values) - len(finite),
        }

    return {"pairs": len(psnrs), "psnr_db": spread(psnrs), "ssim": spread(ssims)}


def evaluate(args: argparse.Namespace) -> dict:
    """Generate (or, with --truth, render) the held-out set, check it, and compare FP8 when asked."""
    scenes = held_out_scenes(args.scenes)
    settings = EvalSettings(
        size=args.size,
        steps=args.steps,
        negative_prompt=None if args.no_cfg else args.negative_prompt,
        true_cfg_scale=args.cfg_scale,
        seed=args.seed,
        languages=tuple(args.languages.split(",")),
    )
    report = {
        "schema": "qwen-image-fusion/meaning-report",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": sys.argv[1:] if args.argv is None else args.argv,
        "held_out": {"scenes": len(scenes), "held_out_percent": HELD_OUT_PERCENT, "seed": HELD_OUT_SEED},
        "settings": asdict(settings),
    }
    if args.truth:
        images = {lang: [np.asarray(render(s, settings.size)) for s in scenes] for lang in settings.languages}
        return report | {"model": "ground-truth renders"} | score(images, scenes)

    from qwen_image_fusion.pipelines import load_pipeline

    pipe = load_pipeline(args.model, variant=args.variant, device=args.device, dtype=args.dtype)
    start = time.perf_counter()
    images, _ = generate_held_out(pipe, scenes, settings, f"held-out ({pipe.variant})")
    report |= {"model": pipe.model_name, "variant": pipe.variant, "seconds": time.perf_counter() - start}
    report |= score(images, scenes)
    save_images(args.out, pipe.variant, images)
    if args.fp8:
        report["fp8"] = compare_fp8(pipe, args, scenes, settings, images)
    if args.cache:
        names = args.cache.split(",")
        report["cache"] = {n: compare_cache(pipe, n, scenes, settings, images, args.out) for n in names}
    return report


def compare_cache(
    pipe, name: str, scenes: list[Scene], settings: EvalSettings, exact_images, out: Path | None
) -> dict:
    """The held-out set again with step-cache preset `name`: its accuracy, the steps it skipped, and its
    images against the exact ones (same pipeline, prompts and seeds)."""
    start = time.perf_counter()
    images, runs = generate_held_out(pipe, scenes, settings, f"held-out (cache {name})", cache=name)
    seconds = time.perf_counter() - start
    save_images(out, f"{pipe.variant}-cache-{name}", images)
    checked = score(images, scenes)
    return {
        "preset": name,
        "seconds": seconds,
        "skipped_steps": skipped_steps(runs),
        "accuracy": checked["accuracy"],
        "versus_exact": image_pair_metrics(exact_images, images),
    }


def compare_fp8(
    pipe, args: argparse.Namespace, scenes: list[Scene], settings: EvalSettings, bf16_images
) -> dict:
    """Quantize this BF16 model (static FP8, calibrated on training captions), regenerate the held-out set
    with fp8-fused (the gate may fall back to unfused, e.g. on CPU), check it, and compare to BF16."""
    from qwen_image_fusion.pipelines import load_pipeline
    from qwen_image_fusion.pipelines.quantize import quantize_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        source = None if args.model is None else Path(args.model)
        quantize_pipeline(
            pipe, Path(tmp) / "fp8", calibration_prompts(args.calib_scenes), steps=settings.steps,
            size=settings.size, seed=CALIBRATION_SEED, source=source,
        )  # fmt: skip
        fp8 = load_pipeline(Path(tmp) / "fp8", variant="fp8-fused", device=args.device, dtype=args.dtype)
        start = time.perf_counter()
        images, _ = generate_held_out(fp8, scenes, settings, f"held-out ({fp8.variant})")
        seconds = time.perf_counter() - start
        fusion = fp8.fusion_summary()
        variant = fp8.variant
    save_images(args.out, variant, images)
    checked = score(images, scenes)
    return {
        "variant": variant,
        "fusion_summary": fusion,
        "calibration_prompts": 2 * args.calib_scenes,
        "seconds": seconds,
        "accuracy": checked["accuracy"],
        "versus_bf16": image_pair_metrics(bf16_images, images),
    }


def skipped_steps(runs: list["CacheReport"]) -> dict:
    """The steps each run's cache skipped (per CFG branch and image, from RunInfo.cache): min, mean and
    max."""
    counts = [count for run in runs for branch in run.skipped.values() for count in branch]
    return {"min": min(counts), "mean": float(np.mean(counts)), "max": max(counts)}


def save_images(out: Path | None, variant: str, images: dict[str, list[np.ndarray]]) -> None:
    if out is None:
        return
    folder = out / "images"
    folder.mkdir(parents=True, exist_ok=True)
    for lang, arrays in images.items():
        for i, pixels in enumerate(arrays):
            Image.fromarray(pixels).save(folder / f"s{i:03d}-{lang}-{variant}.png")


def summary_lines(report: dict) -> list[str]:
    def line(name: str, acc: dict) -> str:
        return (
            f"{name}: colour+position {acc['colour_position']:.1%}, count {acc['count']:.1%}, "
            f"shape {acc['shape']:.1%} over {acc['images']} images"
        )

    lines = [f"model: {report['model']}" + (f" ({report['variant']})" if "variant" in report else "")]
    lines += [line(lang, acc) for lang, acc in report["accuracy"].items()]
    lines += [line(f"chance ({lang}, shuffled descriptions)", acc) for lang, acc in report["chance"].items()]
    if "fp8" in report:
        fp8 = report["fp8"]
        lines += [line(f"fp8 {fp8['variant']} {lang}", acc) for lang, acc in fp8["accuracy"].items()]
        p, s = fp8["versus_bf16"]["psnr_db"], fp8["versus_bf16"]["ssim"]
        lines.append(
            f"fp8 vs bf16: PSNR min/median {p['min']:.2f}/{p['median']:.2f} dB, "
            f"SSIM min/median {s['min']:.4f}/{s['median']:.4f} over {fp8['versus_bf16']['pairs']} pairs"
        )
    for name, cached in report.get("cache", {}).items():
        lines += [line(f"cache {name} {lang}", acc) for lang, acc in cached["accuracy"].items()]
        p, s, k = cached["versus_exact"]["psnr_db"], cached["versus_exact"]["ssim"], cached["skipped_steps"]
        lines.append(
            f"cache {name} vs exact: PSNR min/median {p['min']:.2f}/{p['median']:.2f} dB, SSIM min/median "
            f"{s['min']:.4f}/{s['median']:.4f}; skipped {k['mean']:.1f} of {report['settings']['steps']} "
            f"steps (mean; {k['min']:g}..{k['max']:g}); {cached['seconds']:.0f} s"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_image_fusion.eval.meaning", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", help="checkpoint directory (default: the embedded default)")
    parser.add_argument(
        "--variant", default="auto", help="pipeline variant for the BF16 model (default auto)"
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--size", type=int, default=256, help="image side in px (default 256)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--negative-prompt", default=" ", help='true-CFG negative prompt (default " ")')
    parser.add_argument("--cfg-scale", type=float, default=4.0)
    parser.add_argument("--no-cfg", action="store_true", help="generate without true CFG")
    parser.add_argument("--scenes", type=int, default=100, help="held-out scenes (default 100)")
    parser.add_argument("--languages", default="en,zh")
    parser.add_argument("--seed", type=int, default=0, help="scene i is generated with seed SEED+i")
    parser.add_argument("--out", type=Path, help="write meaning.json and images/ here")
    parser.add_argument(
        "--truth", action="store_true", help="check the ground-truth renders (validates the checker)"
    )
    parser.add_argument(
        "--fp8", action="store_true", help="also quantize to FP8 and compare with the BF16 images"
    )
    parser.add_argument("--calib-scenes", type=int, default=16, help="training scenes for FP8 calibration")
    parser.add_argument(
        "--cache", help="also with these step-cache presets (comma-separated), compared with the exact images"
    )
    args = parser.parse_args(argv)
    args.argv = argv
    if args.size % 16 or not 16 <= args.size <= 2048:
        raise InputError(f"--size {args.size} must be a multiple of 16 in [16, 2048]")
    if args.scenes < 2:
        raise InputError("--scenes must be at least 2 (the chance level pairs each scene with the next)")
    unknown = set(args.languages.split(",")) - set(LANGUAGES)
    if unknown:
        raise InputError(f"unknown language(s) {sorted(unknown)}: choose from {', '.join(LANGUAGES)}")
    for name in args.cache.split(",") if args.cache else ():
        if get_cache_preset(name) is None:
            raise InputError("--cache: name step-cache presets, not 'off'")
    if args.model is not None and not Path(args.model).is_dir():
        raise InputError(f"model directory not found: {args.model}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        report = evaluate(args)
    except QwenImageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(report, args.out / "meaning.json")
    print("\n".join(summary_lines(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
