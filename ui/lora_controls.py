"""Presets, the step cache, the fast decode and LoRA scales in the demo: the controls, and the `generate()`
arguments they make.

Self-contained: the layout (ui/app.py) places `lora_controls(...)` and passes the state it returns to
`generate()` as keyword arguments. LoRAs are mounted once at start-up at scale 0 (off), so switching one
on or off at run time never reloads weights.
"""

from collections.abc import Sequence
from typing import Any

import gradio as gr

from qwen_image_fusion.models.cache_presets import CACHE_OFF, CACHE_PRESETS
from qwen_image_fusion.pipelines.presets import PRESETS, presets_for

NO_PRESET = "none"
NO_CACHE = CACHE_OFF


def run_kwargs(
    names: Sequence[str], preset: str, cache: str, fast_decode: bool, scales: Sequence[float]
) -> dict[str, Any]:
    """`generate()` arguments for the control values: the preset (none: the model's own scheduler and
    defaults), the step cache (off: every block runs), the fast decode (asked for only when ticked) and
    the scale of each loaded LoRA."""
    kwargs: dict[str, Any] = {"preset": None if preset == NO_PRESET else preset}
    kwargs["cache"] = None if cache == NO_CACHE else cache
    if fast_decode:
        kwargs["fast_decode"] = True
    if names:
        kwargs["lora_scales"] = {name: float(scale) for name, scale in zip(names, scales, strict=True)}
    return kwargs


def preset_settings(preset: str, steps: float, cfg: float) -> tuple[float, float]:
    """The steps and true-CFG scale a preset sets (unchanged for none)."""
    chosen = PRESETS.get(preset)
    return (steps, cfg) if chosen is None else (chosen.num_inference_steps, chosen.true_cfg_scale)


def lora_controls(pipe: Any, steps: gr.Slider, cfg: gr.Slider) -> gr.State:
    """A preset choice, a step-cache choice, the fast-decode box (where the model's VAE has the 2D form) and
    one scale slider per loaded LoRA (call inside the Blocks layout); returns the State holding the
    `generate()` arguments they make. Picking a preset also sets the steps and CFG."""
    loras = getattr(pipe, "loras", {})  # a pipeline without LoRA support offers the presets only
    spec = getattr(pipe, "spec", None)  # the presets made for the model's family (all for a stand-in)
    family = None if spec is None else spec.family.name
    names = list(loras)
    state = gr.State(run_kwargs(names, NO_PRESET, NO_CACHE, False, [loras[name].scale for name in names]))
    with gr.Accordion("Preset, step cache and LoRA", open=bool(names)):
        preset = gr.Dropdown(
            [("none (the model's scheduler and defaults)", NO_PRESET)]
            + [(p.describe(), p.name) for p in presets_for(family)],
            value=NO_PRESET,
            label="Preset",
            elem_id="preset",
        )
        cache = gr.Dropdown(
            [("off (exact: every block runs)", NO_CACHE)]
            + [(f"{p.describe()} (approximate)", p.name) for p in CACHE_PRESETS.values()],
            value=NO_CACHE,
            label="Step cache",
            elem_id="cache",
        )
        fast_decode = gr.Checkbox(
            False,
            label="Fast decode (approximate: a few pixel levels off the exact decode; ~40% less decoding)",
            elem_id="fast_decode",
            visible=bool(getattr(spec, "fast_decode", False)),
        )
        sliders = [
            gr.Slider(-2.0, 2.0, loras[name].scale, step=0.05, label=f"LoRA {name} (0 = off)")
            for name in names
        ]
    private = {"queue": False, "api_visibility": "private"}
    preset.input(preset_settings, [preset, steps, cfg], [steps, cfg], **private)
    controls = [preset, cache, fast_decode, *sliders]
    for control in controls:
        control.change(lambda p, c, f, *s: run_kwargs(names, p, c, f, s), controls, state, **private)
    return state


def lora_details(run: Any) -> str:
    """Markdown lines for the details panel: the preset, the approximate paths that ran (a step cache's
    skips, the 2D decode, a fast decode that fell back) and the LoRAs ('' without them)."""
    preset, loras = getattr(run, "preset", ""), getattr(run, "loras", "")
    approximations = run.approximations() if hasattr(run, "approximations") else {}
    lines = [
        f"**Preset:** {preset}" if preset else "",
        *(f"**{label}:** {text}" for label, text in approximations.items()),
        f"**{loras}**" if loras else "",
    ]
    return "".join(f"\n{line}  " for line in lines if line)
