"""The Edit family's presets: the Qwen-Image-Edit, Edit-2509 and Edit-2511 Lightning releases (lightx2v), on
the schedule of the text-to-image Lightning LoRAs (docs/DESIGN.md §8)."""

from qwen_image_fusion.models.presets import Preset
from qwen_image_fusion.models.qwen_image.presets import LIGHTNING_SCHEDULER

EDIT_LIGHTNING_PRESETS = tuple(
    Preset(
        f"edit-lightning-{steps}",
        steps,
        1.0,
        LIGHTNING_SCHEDULER,
        f"Qwen-Image-Edit-*Lightning-{steps}steps-*.safetensors",
    )
    for steps in (8, 4)
)
