"""Qwen-Image's presets: the Qwen-Image-Lightning releases' 8- and 4-step schedules (docs/DESIGN.md §7)."""

import math
from typing import Any

from qwen_image_fusion.models.presets import Preset

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
LIGHTNING_PRESETS = tuple(
    Preset(
        f"lightning-{steps}",
        steps,
        1.0,
        LIGHTNING_SCHEDULER,
        f"Qwen-Image-Lightning-{steps}steps-*.safetensors",
    )
    for steps in (8, 4)
)
