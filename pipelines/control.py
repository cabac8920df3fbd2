"""ControlNet requests (torch-free): the control images a request carries, each one's conditioning scale and
the share of the schedule it guides, as diffusers' `QwenImageControlNetPipeline` takes them; and the control
modes that turn a photo into a control map here (`canny`). The Union ControlNet reads which kind of map
it is given (canny, depth, pose, soft edge) from the map itself.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import PIL.Image

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.family import CheckpointSpec
from qwen_image_fusion.pipelines.limits import check_pixels

CONTROL_MODES = ("canny",)  # the maps made here from a photo; others are given as maps
MAPS_BROUGHT = ("depth", "pose", "soft_edge")  # Union modes whose detectors are not part of this project
ASPECT_TOLERANCE = 0.02  # a control map stretched more than this to the output size is refused
CANNY_SIGMA = 1.0
CANNY_THRESHOLDS = (0.1, 0.2)  # low, high: gradient magnitudes of the [0, 1] grey image


@dataclass(frozen=True)
class Control:
    """A request's control images (maps), each one's conditioning scale, and the part of the schedule they
    guide (`guidance_start` to `guidance_end`, fractions of the steps: diffusers' `control_guidance_*`); for
    an inpainting ControlNet, its one image and the `mask` of what it repaints (white)."""

    images: tuple[PIL.Image.Image, ...]
    scales: tuple[float, ...]
    guidance_start: float = 0.0
    guidance_end: float = 1.0
    mask: PIL.Image.Image | None = None

    def step_scales(self, steps: int) -> list[list[float]]:
        """Each step's scale for each image: its scale inside the guided part, 0 outside (diffusers'
        `controlnet_keep`)."""
        keep = [
            1.0 - float(i / steps < self.guidance_start or (i + 1) / steps > self.guidance_end)
            for i in range(steps)
        ]
        return [[scale * k for scale in self.scales] for k in keep]

    def check_aspect(self, width: int, height: int, multiple: int) -> None:
        """InputError when a control image's aspect differs from the output's (beyond what rounding the
        output's sides to `multiple` makes): it would be stretched."""
        slack = math.log1p(ASPECT_TOLERANCE + multiple / min(width, height))
        for i, image in enumerate(self.images):
            theirs, ours = image.width / image.height, width / height
            if abs(math.log(theirs / ours)) > slack:
                raise InputError(
                    f"control_image {i + 1} is {image.width}x{image.height} (aspect {theirs:.3g}) but the "
                    f"output is {width}x{height} (aspect {ours:.3g}): it would be stretched; crop it or ask "
                    "for a size of its aspect",
                    "control_image",
                )


def check_control(
    spec: CheckpointSpec,
    images: PIL.Image.Image | Sequence[PIL.Image.Image] | None,
    scales: float | Sequence[float] | None,
    guidance_start: float,
    guidance_end: float,
    mode: str | None,
    mask: PIL.Image.Image | None = None,
) -> Control | None:
    """The request's control (None without control images), checked: InputError for a scale, mode or mask
    without an image, a checkpoint without a ControlNet, a non-image, a scale count other than one or one
    per image, a scale that is not a finite number, a guidance range outside 0 <= start < end <= 1, an
    unknown mode, or a mask where the ControlNet does not inpaint (where it does: exactly one image and a
    mask of its size). A `mode` makes each image's map here (`canny`)."""
    if images is None:
        named = ((scales, "controlnet_conditioning_scale"), (mode, "control_mode"), (mask, "control_mask"))
        for value, name in named:
            if value is not None:
                raise InputError(f"{name} needs the control image it applies to (control_image)", name)
        return None
    if not spec.takes_control:
        raise InputError(
            f"control_image needs a ControlNet, and {spec.name} holds none: give a "
            "QwenImageControlNetPipeline checkpoint",
            "control_image",
        )
    images = [images] if isinstance(images, PIL.Image.Image) else list(images)
    if not images:
        raise InputError("control_image is an empty list", "control_image")
    for i, image in enumerate(images):
        if not isinstance(image, PIL.Image.Image):
            raise InputError(
                f"control_image {i + 1} is a {type(image).__name__}, not a PIL image", "control_image"
            )
        check_pixels(image.width, image.height, f"control_image {i + 1}", "control_image")
    scales = [1.0] if scales is None else [scales] if isinstance(scales, int | float) else list(scales)
    if len(scales) == 1:
        scales = scales * len(images)
    if len(scales) != len(images):
        raise InputError(
            f"controlnet_conditioning_scale has {len(scales)} values for {len(images)} control images",
            "controlnet_conditioning_scale",
        )
    for scale in scales:
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise InputError(
                f"controlnet_conditioning_scale must be finite numbers, got {scale!r}",
                "controlnet_conditioning_scale",
            )
    for value, name in ((guidance_start, "control_guidance_start"), (guidance_end, "control_guidance_end")):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise InputError(f"{name} must be a number in [0, 1], got {value!r}", name)
    if guidance_start >= guidance_end:
        raise InputError(
            f"control_guidance_start {guidance_start} must be below control_guidance_end {guidance_end}",
            "control_guidance_start",
        )
    check_control_mask(spec, images, mask)
    maps = [control_map(image, mode) for image in images]
    window = float(guidance_start), float(guidance_end)
    return Control(tuple(maps), tuple(float(s) for s in scales), *window, mask)


def check_control_mask(spec: CheckpointSpec, images: list[PIL.Image.Image], mask: object) -> None:
    """InputError unless an inpainting ControlNet gets one image and a mask of its size, and any other
    ControlNet no mask."""
    if not spec.control_inpaints:
        if mask is not None:
            raise InputError(
                f"control_mask needs an inpainting ControlNet, and {spec.name}'s does not inpaint",
                "control_mask",
            )
        return
    if len(images) != 1:
        raise InputError(
            f"control_image: {spec.name}'s inpainting ControlNet takes one image, not {len(images)}",
            "control_image",
        )
    if mask is None:
        raise InputError(
            f"control_mask is required: {spec.name}'s ControlNet repaints the mask's white part",
            "control_mask",
        )
    if not isinstance(mask, PIL.Image.Image):
        raise InputError(f"control_mask is a {type(mask).__name__}, not a PIL image", "control_mask")
    if mask.size != images[0].size:
        raise InputError(
            f"control_mask is {mask.width}x{mask.height} but control_image is "
            f"{images[0].width}x{images[0].height}: give a mask of the image's size",
            "control_mask",
        )


def control_map(image: PIL.Image.Image, mode: str | None) -> PIL.Image.Image:
    """`image` as the ControlNet's map: as given (mode None), or its Canny edges (white on black)."""
    if mode is None:
        return image
    if mode in MAPS_BROUGHT:
        raise InputError(
            f"control_mode {mode!r} needs a detector this project does not ship: give the {mode} map itself "
            "as the control image (the Union ControlNet reads the kind of map from it), without control_mode",
            "control_mode",
        )
    if mode not in CONTROL_MODES:
        raise InputError(f"control_mode {mode!r} is not one of {', '.join(CONTROL_MODES)}", "control_mode")
    from skimage.feature import canny

    grey = np.asarray(image.convert("L"), dtype=np.float64) / 255.0
    low, high = CANNY_THRESHOLDS
    edges = canny(grey, sigma=CANNY_SIGMA, low_threshold=low, high_threshold=high)
    return PIL.Image.fromarray(np.where(edges, 255, 0).astype(np.uint8)).convert("RGB")
