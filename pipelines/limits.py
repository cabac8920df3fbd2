"""Argument limits shared by the pipeline, the CLI, the UI and eval; cheap to import (no torch)."""

from models.errors import InputError

VARIANTS = ("reference", "contract", "fp8-unfused", "fp8-fused")
MAX_SIDE = 2048
MIN_STEPS = 2  # one step divides by zero in the scheduler's terminal-shift stretch
MAX_STEPS = 200
MAX_IMAGES = 16


def check_size(width: object, height: object) -> None:
    """InputError unless both sides are multiples of 16 in [16, MAX_SIDE]."""
    for name, side in (("width", width), ("height", height)):
        if not isinstance(side, int) or side % 16 or not 16 <= side <= MAX_SIDE:
            raise InputError(f"{name} {side} must be a multiple of 16 between 16 and {MAX_SIDE}")


def check_steps(steps: object) -> None:
    """InputError unless MIN_STEPS <= steps <= MAX_STEPS."""
    if not isinstance(steps, int) or not MIN_STEPS <= steps <= MAX_STEPS:
        raise InputError(
            f"num_inference_steps {steps} must be between {MIN_STEPS} and {MAX_STEPS} "
            "(a single step divides by zero in the scheduler's terminal-shift stretch)"
        )
