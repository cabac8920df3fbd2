"""Requests of a prompt set: a prompt and its input image files (none for text to image), as `quantize`
calibrates on them and `qwen_image_fusion.eval.parity` compares over them. Torch-free.

A prompt file (`.txt`) holds one prompt per line. An edit set (`.jsonl`) holds one JSON object per line,
`{"prompt": "make the sky red", "images": ["photo.png"]}`, image paths relative to the file (blank lines
skipped); a line may instead start from an image (img2img) and repaint only a mask's white part (inpainting):
`{"prompt": "a red fox", "init_image": "photo.png", "mask": "mask.png", "strength": 0.8}` (mask and strength
optional), or, for an Edit checkpoint that inpaints, mask its one input image: `{"prompt": "a red door",
"images": ["photo.png"], "mask": "mask.png"}`; or be guided by control maps (a ControlNet checkpoint):
`{"prompt": "a house", "control": ["edges.png"], "control_scale": 0.8}`, with `"control_mode": "canny"` to
make the map from a photo, and `"control_mask": "mask.png"` for an inpainting ControlNet. The built-in sets
(`edit`: one image each; `edit-plus`: two or three; `img2img` and `inpaint`: start images and masks;
`control`: the scenes' canny edges; `control-inpaint`: `inpaint`'s images and masks for an inpainting
ControlNet; `edit-inpaint`: the same as inpainting edits) sit in `pipelines/edit_sets/` with images the
project draws itself (`python -m qwen_image_fusion.eval.draw_edit_sets`).
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import CheckpointSpec
from qwen_image_fusion.pipelines.images import open_input_image
from qwen_image_fusion.pipelines.limits import check_image_count
from qwen_image_fusion.pipelines.prompts import read_prompt_file

EDIT_SET_SUFFIX = ".jsonl"
EDIT_SETS_DIR = Path(__file__).parent / "edit_sets"
BUILTIN_EDIT_SETS = (
    "edit",
    "edit-plus",
    "img2img",
    "inpaint",
    "control",
    "control-inpaint",
    "edit-inpaint",
)


@dataclass(frozen=True)
class Request:
    """A prompt and the image files it edits (empty: text to image), or the image it starts from (img2img),
    the mask of what it repaints (inpainting) and the strength (None: the default), or the control images
    that guide a ControlNet, their mode and scale (None: the defaults)."""

    prompt: str
    images: tuple[Path, ...] = ()
    init_image: Path | None = None
    mask: Path | None = None
    strength: float | None = None
    control: tuple[Path, ...] = ()
    control_mode: str | None = None
    control_scale: float | None = None
    control_mask: Path | None = None

    @property
    def files(self) -> tuple[Path, ...]:
        """Every image file it reads."""
        every = (*self.images, self.init_image, self.mask, *self.control, self.control_mask)
        return tuple(p for p in every if p is not None)

    def generation_inputs(self) -> dict[str, object]:
        """Its images opened, as `Pipeline.generate`'s keyword arguments (with its strength and control)."""

        def opened(path: Path | None) -> object:
            return None if path is None else open_input_image(path)

        return {
            "image": [open_input_image(path) for path in self.images] or None,
            "init_image": opened(self.init_image),
            "mask_image": opened(self.mask),
            "strength": self.strength,
            "control_image": [open_input_image(path) for path in self.control] or None,
            "control_mode": self.control_mode,
            "controlnet_conditioning_scale": self.control_scale,
            "control_mask": opened(self.control_mask),
        }


def parse_edit_set(text: str, base: Path, where: str) -> list[Request]:
    """The requests of an edit set's text; image paths resolved against `base`. InputError naming `where`
    and the line for anything else than a prompt and a non-empty list of existing image files."""
    requests = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{where} line {number} is not JSON: {err.msg}") from None
        prompt = entry.get("prompt") if isinstance(entry, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError(f'{where} line {number} needs a non-empty "prompt" string')
        requests.append(_request(entry, base, f"{where} line {number}"))
    if not requests:
        raise InputError(f"no requests in {where}")
    return requests


def _request(entry: dict, base: Path, where: str) -> Request:
    """One edit-set line's request: input images, a start image with its mask and strength, or control
    images with their mode and scale."""
    start, control = entry.get("init_image"), entry.get("control")
    images = entry.get("images", [] if start is not None or control is not None else None)
    well_formed = isinstance(images, list) and all(isinstance(i, str) for i in images)
    if not well_formed or not (images or start or control is not None):
        raise InputError(
            f'{where} needs "images": a non-empty list of file names (or an "init_image", or "control")'
        )
    if control is not None and (
        not isinstance(control, list) or not control or not all(isinstance(i, str) for i in control)
    ):
        raise InputError(f'{where}: "control" must be a non-empty list of file names')
    mode, control_scale = entry.get("control_mode"), entry.get("control_scale")
    if mode is not None and not isinstance(mode, str):
        raise InputError(f'{where}: "control_mode" must be a string')
    if control_scale is not None and (
        isinstance(control_scale, bool) or not isinstance(control_scale, int | float)
    ):
        raise InputError(f'{where}: "control_scale" must be a number')
    names = {"init_image": start, "mask": entry.get("mask"), "control_mask": entry.get("control_mask")}
    if names["mask"] is not None and start is None and len(images) != 1:
        raise InputError(f'{where}: "mask" needs the "init_image" (or the one of "images") it masks')
    if names["control_mask"] is not None and control is None:
        raise InputError(f'{where}: "control_mask" needs the "control" image it masks')
    for key, name in names.items():
        if name is not None and not isinstance(name, str):
            raise InputError(f'{where}: "{key}" must be a file name')
    strength = entry.get("strength")
    if strength is not None and (isinstance(strength, bool) or not isinstance(strength, int | float)):
        raise InputError(f'{where}: "strength" must be a number')
    paths = tuple(base / name for name in images)
    start_paths = {key: None if name is None else base / name for key, name in names.items()}
    control_paths = tuple(base / name for name in control or ())
    every = (*paths, *start_paths.values(), *control_paths)
    missing = [str(p) for p in every if p is not None and not p.is_file()]
    if missing:
        raise InputError(f"{where}: image {missing[0]} does not exist")
    return Request(
        entry["prompt"],
        paths,
        start_paths["init_image"],
        start_paths["mask"],
        strength,
        control_paths,
        mode,
        control_scale,
        start_paths["control_mask"],
    )


def read_edit_set(path: Path) -> list[Request]:
    """The requests of an edit set file; InputError when it cannot be read or is malformed."""
    if not path.is_file():
        raise InputError(f"edit set not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read edit set {path}: {err}") from err
    return parse_edit_set(text, path.parent, str(path))


def builtin_edit_set(name: str) -> list[Request]:
    """A built-in edit set by name (BUILTIN_EDIT_SETS)."""
    return read_edit_set(EDIT_SETS_DIR / f"{name}{EDIT_SET_SUFFIX}")


def read_requests(path: Path) -> list[Request]:
    """An edit set (`.jsonl`) or a prompt file (anything else) as requests."""
    if path.suffix == EDIT_SET_SUFFIX:
        return read_edit_set(path)
    return [Request(prompt) for prompt in read_prompt_file(path)]


def as_requests(items: Sequence[str | Request]) -> list[Request]:
    """Plain prompts as text-to-image requests; requests pass through."""
    return [item if isinstance(item, Request) else Request(item) for item in items]


def check_requests(
    requests: Sequence[Request],
    max_images: int,
    required: bool,
    model: str,
    starts: bool = False,
    controls: bool = False,
    inpaints: bool = False,
) -> None:
    """InputError naming the first request whose images the model cannot take (before it loads): their
    count, a start image for a model that does not start from images (`starts`), or control images for
    one without a ControlNet (`controls`), or a mask on an input image for one that does not inpaint its
    input image (`inpaints`)."""
    for number, request in enumerate(requests, 1):
        try:
            if request.init_image is not None and not starts:
                raise InputError(f"{model} does not start from an image (img2img, inpainting)")
            if request.control and not controls:
                raise InputError(f"{model} holds no ControlNet (control images)")
            if request.mask is not None and request.init_image is None and not inpaints:
                raise InputError(f"{model} does not inpaint its input image (a mask with images)")
            check_image_count(len(request.images), max_images, required, model)
        except InputError as err:
            raise InputError(f"request {number} ({request.prompt[:40]!r}): {err}") from None


def check_requests_for(requests: Sequence[Request], spec: CheckpointSpec) -> None:
    """`check_requests` against what `spec`'s checkpoint takes."""
    check_requests(
        requests,
        spec.max_images,
        spec.images_required,
        spec.name,
        spec.starts_from_image,
        spec.takes_control,
        spec.inpaints_input,
    )


def edit_requests_for(max_images: int) -> list[Request]:
    """The built-in edit requests a model taking `max_images` images can run: `edit`, and `edit-plus` too
    when it takes several."""
    requests = builtin_edit_set("edit")
    if max_images > 1:
        requests += [r for r in builtin_edit_set("edit-plus") if len(r.images) <= max_images]
    return requests
