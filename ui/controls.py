"""The settings both demo forms (Generate, Edit) offer below their size choice: width and height, steps, true
CFG scale, seed, image count, variant, and the preset and LoRA controls. Ranges and help come from the
request options' declarations (pipelines/options.py); defaults from the pipeline."""

from dataclasses import dataclass
from typing import Any

import gradio as gr

from qwen_image_fusion.pipelines.options import OPTION, Option
from qwen_image_fusion.ui.generation import RANDOM_SEED, VARIANT_LABELS
from qwen_image_fusion.ui.lora_controls import lora_controls


@dataclass(frozen=True)
class Settings:
    """One form's setting components (their values reach the request in INPUT_NAMES' terms)."""

    width: gr.Number
    height: gr.Number
    steps: gr.Slider
    cfg: gr.Slider
    seed: gr.Number
    randomize: gr.Checkbox
    used_seed: gr.Number  # hidden: the seed a run used (an output)
    num_images: gr.Slider
    variant: gr.Dropdown
    lora_kwargs: gr.State


def settings_controls(pipe: Any, variants: list[str], prefix: str = "") -> Settings:
    """The settings components (call inside a layout column), element ids prefixed by `prefix`; defaults
    are the pipeline's."""
    defaults = pipe.defaults
    with gr.Row():
        width = gr.Number(defaults.width, label="Width", precision=0, elem_id=f"{prefix}width")
        height = gr.Number(defaults.height, label="Height", precision=0, elem_id=f"{prefix}height")
    with gr.Row():
        steps = option_slider(
            OPTION["num_inference_steps"], defaults.num_inference_steps, "Steps", 1, elem_id=f"{prefix}steps"
        )
        cfg = option_slider(OPTION["true_cfg_scale"], defaults.true_cfg_scale, "True CFG scale", 0.1)
    with gr.Row():
        seed = gr.Number(
            RANDOM_SEED,
            label="Seed (-1: random)",
            precision=0,
            minimum=RANDOM_SEED,
            elem_id=f"{prefix}seed",
        )
        randomize = gr.Checkbox(False, label="Randomize seed")
        used_seed = gr.Number(label="Seed used", precision=0, visible=False)
        images = OPTION["num_images_per_prompt"]
        num_images = option_slider(images, images.default, "Images", 1)
    variant = gr.Dropdown(
        [(VARIANT_LABELS.get(v, v), v) for v in variants],
        value=pipe.variant,
        label="Pipeline variant",
        visible=len(variants) > 1,
    )
    lora_kwargs = lora_controls(pipe, steps, cfg)
    return Settings(width, height, steps, cfg, seed, randomize, used_seed, num_images, variant, lora_kwargs)


def option_range(option: Option) -> tuple[float, float]:
    """The span of a request option's demo slider: its declared demo range, else its bounds where a
    server takes requests."""
    return option.demo_range or option.served_bounds


def option_slider(option: Option, value: float, label: str, step: float, **kwargs: Any) -> gr.Slider:
    """A slider for a request option: its declared range, `value`, its declared help as the info line."""
    low, high = option_range(option)
    if option.low_open:
        low += step  # (0, 1]: the first step above 0
    return gr.Slider(low, high, value, step=step, label=label, info=option.help, **kwargs)


def settings_fields(settings: Settings) -> list[Any]:
    """The settings' components in INPUT_NAMES' order after the size choice (width ... variant)."""
    s = settings
    return [s.width, s.height, s.steps, s.cfg, s.seed, s.randomize, s.num_images, s.variant]
