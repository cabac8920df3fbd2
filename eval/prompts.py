"""Prompt sets: a text file with one prompt per line, or a built-in set name (smoke, diverse).

Blank lines and lines whose first non-space character is '#' are skipped; a '#' later in a line is
part of the prompt.
"""

from importlib import resources
from pathlib import Path

from models.errors import InputError
from pipelines.prompts import parse_prompts, read_prompt_file


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
