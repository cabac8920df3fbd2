"""Prompt files: one prompt per line; blank lines and lines starting with '#' are skipped."""

from pathlib import Path

from qwen_image_fusion.models.errors import InputError


def parse_prompts(text: str) -> list[str]:
    """The prompts of a prompt file's text (a '#' later in a line is part of the prompt)."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def read_prompt_file(path: Path) -> list[str]:
    """Prompts of a UTF-8 text file; InputError when it cannot be read or holds none."""
    if not path.is_file():
        raise InputError(f"prompt file not found: {path}")
    try:
        prompts = parse_prompts(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read prompt file {path}: {exc}") from exc
    if not prompts:
        raise InputError(f"no prompts in {path} (one per line; '#' starts a comment line)")
    return prompts
