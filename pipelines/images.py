"""Input image files (the CLI's `--image`, the web demo's uploads, edit sets), read and checked before any
model loads. Torch-free: a file that is no image, a truncated one, or one above the pixel or byte cap fails
in one line naming the file, and nothing heavier than Pillow has been imported."""

from pathlib import Path

import PIL.Image
import PIL.ImageOps

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines.limits import check_image_count, check_pixels

MAX_INPUT_BYTES = 40 * 1024 * 1024  # an input image file larger than this is refused (the demo's upload cap)


def open_input_image(path: str | Path, max_bytes: int | None = None, field: str = "image") -> PIL.Image.Image:
    """The image of a file, decoded and turned upright by its EXIF orientation (as diffusers' load_image;
    mode kept: a model may read alpha): InputError (for request option `field`) for a missing file, a file
    over `max_bytes`, one Pillow cannot read, one above the pixel cap (from its header, before decoding) or
    a truncated one."""
    path = Path(path)
    if not path.is_file():
        raise InputError(
            f"input image {path} {'is not a file' if path.exists() else 'does not exist'}", field
        )
    size = path.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise InputError(
            f"input image {path} is {size / 2**20:.1f} MB: at most {max_bytes / 2**20:g} MB", field
        )
    try:
        image = PIL.Image.open(path)
    except (PIL.UnidentifiedImageError, OSError) as err:
        what = type(err).__name__
        raise InputError(f"input image {path} is not an image Pillow can read ({what})", field) from None
    check_pixels(image.width, image.height, f"input image {path}", field)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as err:  # Pillow's decoders raise these for broken data
        raise InputError(f"input image {path} is truncated or corrupt: {err}", field) from None
    return PIL.ImageOps.exif_transpose(image)


def read_input_images(
    paths: list[str | Path], max_images: int, required: bool, model: str, max_bytes: int | None = None
) -> list[PIL.Image.Image]:
    """The images of `paths`, after checking that the model takes that many
    (qwen_image_fusion.pipelines.limits)."""
    check_image_count(len(paths), max_images, required, model)
    return [open_input_image(path, max_bytes) for path in paths]
