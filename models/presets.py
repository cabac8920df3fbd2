"""A generation preset as plain data: step count, true-CFG scale and the FlowMatchEulerDiscreteScheduler
config a distilled LoRA was made for. Families list theirs (`ModelFamily.presets`); torch-free."""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    """Step count, true-CFG scale and FlowMatchEulerDiscreteScheduler config for a distilled LoRA."""

    name: str
    num_inference_steps: int
    true_cfg_scale: float
    scheduler: dict[str, Any]
    lora: str  # the LoRA file the preset is made for (load it with --lora)

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
