"""Prompt sets: a text file with one prompt per line, or a built-in set name (smoke, diverse); and edit
sets (image + instruction pairs, pipelines/requests.py): a `.jsonl` file, or the built-in `edit` and
`edit-plus`.

Blank lines and lines whose first non-space character is '#' are skipped; a '#' later in a line is
part of the prompt.
"""

from importlib import resources
from pathlib import Path

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.pipelines.prompts import parse_prompts, read_prompt_file
from qwen_image_fusion.pipelines.requests import (
    BUILTIN_EDIT_SETS,
    Request,
    as_requests,
    builtin_edit_set,
    read_requests,
)


def builtin_sets() -> list[str]:
    folder = resources.files("eval") / "prompts"
    return sorted(
        entry.name.removesuffix(".txt") for entry in folder.iterdir() if entry.name.endswith(".txt")
    )


def load_prompts(spec: str) -> list[str]:
    """Prompts of a file, else of a built-in set. InputError when neither exists or it has no prompt."""
    path = Path(spec)
    if path.is_file():
        return read_prompt_file(path)
    if spec not in builtin_sets():
        raise InputError(f"prompt file not found: {spec} (built-in sets: {', '.join(builtin_sets())})")
    return parse_prompts((resources.files("eval") / "prompts" / f"{spec}.txt").read_text(encoding="utf-8"))


def load_requests(spec: str) -> list[Request]:
    """The requests of a prompt file or edit set (`.jsonl`), else of a built-in prompt or edit set."""
    path = Path(spec)
    if path.is_file():
        return read_requests(path)
    if spec in BUILTIN_EDIT_SETS:
        return builtin_edit_set(spec)
    if spec not in builtin_sets():
        names = ", ".join([*builtin_sets(), *BUILTIN_EDIT_SETS])
        raise InputError(f"prompt file not found: {spec} (built-in sets: {names})")
    return as_requests(load_prompts(spec))
