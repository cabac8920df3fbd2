"""Generation presets as plain data, and LoRA file arguments (`FILE[:SCALE]`).

Torch-free, so the CLI and the UI show the presets and refuse a bad LoRA argument before any model loads.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import InputError

# The scheduler configuration Qwen-Image-Lightning was distilled for ("We use shift=3 in distillation"),
# from ModelTC/Qwen-Image-Lightning generate_with_diffusers.py (docs/DESIGN.md §7 gives the source); the
# same script runs the Edit Lightning LoRAs with it (its QwenImageEditPipeline branch, DESIGN §8).
LIGHTNING_SCHEDULER: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": math.log(3),
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": math.log(3),
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": None,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
LORA_MODES = ("branch", "merge")


@dataclass(frozen=True)
class Preset:
    """Step count, true-CFG scale and FlowMatchEulerDiscreteScheduler config for a distilled LoRA."""

    name: str
    num_inference_steps: int
    true_cfg_scale: float
    scheduler: dict[str, Any]
    lora: str  # the LoRA file the preset is made for (load it with --lora)
    families: tuple[str, ...] = ("qwen-image",)  # the model families its LoRAs were distilled for

    def describe(self) -> str:
        """One line for --help and the UI."""
        s = self.scheduler
        cfg = "off" if self.true_cfg_scale <= 1 else f"{self.true_cfg_scale:g}"
        return (
            f"{self.name}: {self.num_inference_steps} steps, true CFG {cfg}, FlowMatch Euler with "
            f"base_shift = max_shift = {s['base_shift']:.4f} (log 3), {s['time_shift_type']} time shift, "
            f"shift_terminal {s['shift_terminal']}; for {self.lora}"
        )

    def make_scheduler(self):
        """A fresh diffusers `FlowMatchEulerDiscreteScheduler` with this preset's config."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler)


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset("lightning-8", 8, 1.0, LIGHTNING_SCHEDULER, "Qwen-Image-Lightning-8steps-*.safetensors"),
        Preset("lightning-4", 4, 1.0, LIGHTNING_SCHEDULER, "Qwen-Image-Lightning-4steps-*.safetensors"),
        # Qwen-Image-Edit, Edit-2509 and Edit-2511 Lightning (lightx2v): the same schedule on Edit checkpoints
        *(
            Preset(
                f"edit-lightning-{steps}",
                steps,
                1.0,
                LIGHTNING_SCHEDULER,
                f"Qwen-Image-Edit-*Lightning-{steps}steps-*.safetensors",
                ("qwen-image-edit",),
            )
            for steps in (8, 4)
        ),
    )
}


def get_preset(name: str | None, family: str | None = None) -> Preset | None:
    """The preset called `name` (None stays None); InputError naming the choices otherwise, or when the
    preset is not made for the model `family` (when given)."""
    if name is None:
        return None
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    preset = PRESETS[name]
    if family is not None and family not in preset.families:
        raise InputError(
            f"preset {name} is made for {' and '.join(preset.families)} checkpoints ({preset.lora}), "
            f"not for the {family} family"
        )
    return preset


def presets_for(family: str | None) -> list[Preset]:
    """The presets made for the model `family` (every preset for None)."""
    return [p for p in PRESETS.values() if family is None or family in p.families]


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
