"""Requests of a prompt set: a prompt and its input image files (none for text to image), as `quantize`
calibrates on them and `eval.parity` compares over them. Torch-free.

A prompt file (`.txt`) holds one prompt per line. An edit set (`.jsonl`) holds one JSON object per line,
`{"prompt": "make the sky red", "images": ["photo.png"]}`, image paths relative to the file (blank lines
skipped). The built-in edit sets (`edit`: one image each; `edit-plus`: two or three) sit in
`pipelines/edit_sets/` with input images the project draws itself (`python -m eval.draw_edit_sets`).
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from models.errors import InputError
from pipelines.limits import check_image_count
from pipelines.prompts import read_prompt_file

EDIT_SET_SUFFIX = ".jsonl"
EDIT_SETS_DIR = Path(__file__).parent / "edit_sets"
BUILTIN_EDIT_SETS = ("edit", "edit-plus")


@dataclass(frozen=True)
class Request:
    """A prompt and the image files it edits (empty: text to image)."""

    prompt: str
    images: tuple[Path, ...] = ()


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
        images = entry.get("images") if isinstance(entry, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError(f'{where} line {number} needs a non-empty "prompt" string')
        if not isinstance(images, list) or not images or not all(isinstance(i, str) for i in images):
            raise InputError(f'{where} line {number} needs "images": a non-empty list of file names')
        paths = tuple(base / name for name in images)
        missing = [str(path) for path in paths if not path.is_file()]
        if missing:
            raise InputError(f"{where} line {number}: image {missing[0]} does not exist")
        requests.append(Request(prompt, paths))
    if not requests:
        raise InputError(f"no requests in {where}")
    return requests


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


def check_requests(requests: Sequence[Request], max_images: int, required: bool, model: str) -> None:
    """InputError naming the first request whose image count the model cannot take (before it loads)."""
    for number, request in enumerate(requests, 1):
        try:
            check_image_count(len(request.images), max_images, required, model)
        except InputError as err:
            raise InputError(f"request {number} ({request.prompt[:40]!r}): {err}") from None


def edit_requests_for(max_images: int) -> list[Request]:
    """The built-in edit requests a model taking `max_images` images can run: `edit`, and `edit-plus` too
    when it takes several."""
    requests = builtin_edit_set("edit")
    if max_images > 1:
        requests += [r for r in builtin_edit_set("edit-plus") if len(r.images) <= max_images]
    return requests
