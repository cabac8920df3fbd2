"""Prompt sets: a text file with one prompt per line, or a built-in set name (smoke, diverse).

Blank lines and lines whose first non-space character is '#' are skipped; a '#' later in a line is
part of the prompt.
"""

from importlib import resources
from pathlib import Path

from models.errors import InputError


def builtin_sets() -> list[str]:
    folder = resources.files("eval") / "prompts"
    return sorted(
        entry.name.removesuffix(".txt") for entry in folder.iterdir() if entry.name.endswith(".txt")
    )


def parse_prompts(text: str) -> list[str]:
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def load_prompts(spec: str) -> list[str]:
    """Prompts of a file, else of a built-in set. InputError when neither exists or it has no prompt."""
    path = Path(spec)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read prompt file {spec}: {exc}") from exc
    elif spec in builtin_sets():
        text = (resources.files("eval") / "prompts" / f"{spec}.txt").read_text(encoding="utf-8")
    else:
        raise InputError(f"prompt file not found: {spec} (built-in sets: {', '.join(builtin_sets())})")
    prompts = parse_prompts(text)
    if not prompts:
        raise InputError(f"no prompts in {spec} (one per line; '#' starts a comment line)")
    return prompts
