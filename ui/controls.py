"""The settings both demo forms (Generate, Edit) offer below their size choice: width and height, steps, true
CFG scale, seed, image count, variant, and the preset and LoRA controls."""

from dataclasses import dataclass
from typing import Any

import gradio as gr

from qwen_image_fusion.pipelines.limits import MAX_STEPS, MIN_STEPS
from qwen_image_fusion.ui.generation import MAX_IMAGES_PER_REQUEST, RANDOM_SEED, VARIANT_LABELS
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
        steps = gr.Slider(
            MIN_STEPS,
            MAX_STEPS,
            defaults.num_inference_steps,
            step=1,
            label="Steps",
            elem_id=f"{prefix}steps",
        )
        cfg = gr.Slider(1.0, 10.0, defaults.true_cfg_scale, step=0.1, label="True CFG scale")
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
        num_images = gr.Slider(1, MAX_IMAGES_PER_REQUEST, 1, step=1, label="Images")
    variant = gr.Dropdown(
        [(VARIANT_LABELS.get(v, v), v) for v in variants],
        value=pipe.variant,
        label="Pipeline variant",
        visible=len(variants) > 1,
    )
    lora_kwargs = lora_controls(pipe, steps, cfg)
    return Settings(width, height, steps, cfg, seed, randomize, used_seed, num_images, variant, lora_kwargs)


def settings_fields(settings: Settings) -> list[Any]:
    """The settings' components in INPUT_NAMES' order after the size choice (width ... variant)."""
    s = settings
    return [s.width, s.height, s.steps, s.cfg, s.seed, s.randomize, s.num_images, s.variant]
