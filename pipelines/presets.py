"""The presets of every registered family by name, and LoRA file arguments (`FILE[:SCALE]`).

Torch-free, so the CLI and the UI show the presets and refuse a bad LoRA argument before any model loads.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import registered_families
from qwen_image_fusion.models.presets import Preset

LORA_MODES = ("branch", "merge")
# every registered family's presets, by name (a preset belongs to the families that list it)
PRESETS: dict[str, Preset] = {p.name: p for family in registered_families() for p in family.presets}


def families_of(preset: Preset) -> list[str]:
    """The families whose checkpoints `preset` is made for."""
    return [family.name for family in registered_families() if preset in family.presets]


def get_preset(name: str | None, family: str | None = None) -> Preset | None:
    """The preset called `name` (None stays None); InputError naming the choices otherwise, or when the
    preset is not made for the model `family` (when given)."""
    if name is None:
        return None
    if name not in PRESETS:
        raise InputError(f"preset {name!r} is not one of {', '.join(PRESETS)}", "preset")
    preset = PRESETS[name]
    owners = families_of(preset)
    if family is not None and family not in owners:
        raise InputError(
            f"preset {name} is made for {' and '.join(owners)} checkpoints ({preset.lora}), "
            f"not for the {family} family",
            "preset",
        )
    return preset


def presets_for(family: str | None) -> list[Preset]:
    """The presets made for the model `family` (every preset for None)."""
    return [p for p in PRESETS.values() if family is None or family in families_of(p)]


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA file and its scale, as given on the command line."""

    path: Path
    scale: float = 1.0


def check_lora_scale(scale: object, what: str) -> float:
    """`scale` as a float; InputError unless it is a finite number."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise InputError(f"LoRA scale {scale!r} for {what} must be a finite number")
    return float(scale)


def parse_lora_spec(text: str) -> LoraSpec:
    """`FILE` or `FILE:SCALE` (split at the last `:`, unless the whole text names a file); the file must
    exist and the scale be a finite number."""
    head, sep, tail = text.rpartition(":")
    path, scale = Path(text), 1.0
    if sep and head and not path.is_file():
        path = Path(head)
        try:
            scale = float(tail)
        except ValueError:
            raise InputError(f"LoRA scale {tail!r} in {text!r} is not a number (FILE[:SCALE])") from None
    check_lora_scale(scale, text)
    if not path.is_file():
        raise InputError(f"LoRA file {path} {'is not a file' if path.exists() else 'does not exist'}")
    return LoraSpec(path, scale)


def lora_name(path: Path, taken: set[str] | dict[str, Any]) -> str:
    """The default name of a LoRA: its file stem, with a number appended when the stem is taken."""
    name, n = path.stem, 2
    while name in taken:
        name, n = f"{path.stem}-{n}", n + 1
    return name


def find_lora_files(directory: Path) -> list[Path]:
    """The `*.safetensors` files of a directory, sorted; InputError when there is none."""
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        raise InputError(f"LoRA directory {directory} {problem}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InputError(f"LoRA directory {directory} holds no *.safetensors files")
    return files


def load_lora_files(pipe: Any, files: Sequence[Path]) -> None:
    """Mount every LoRA file at scale 0 (off until a request's `lora_scales` or a slider sets one): what a
    server's `--lora-dir` loads, once, so switching a LoRA on never reloads weights."""
    for path in files:
        pipe.load_lora(path, scale=0.0)
