"""The demo's Edit tab, shown when the loaded model edits images: one image input per image the model takes
(Picture 1, 2, ...), the instruction, and generate's settings; its event is the API's "/edit". For a
text-to-image model that starts from images it is the "Image to image" tab: the start image, an optional
mask (white: repainted) and the strength, through the same "/edit" event; a model that inpaints its input
image (Edit) takes the same mask, strength and `padding_mask_crop` on its Edit tab. On a ControlNet
checkpoint the "Image to image" tab also lets the image guide the model instead: as a control map, or by its
canny edges (`role`), at a control scale.

Uploads are bounded (ui/uploads.py: images only, byte and pixel caps, stated on the tab); each request's
images are files this server received, opened and checked again before it queues (ui/generation.py's
`job_from_edit_inputs`). The layout only: build_app (ui/app.py) passes the request handlers it shares
with the Generate form.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr

from qwen_image_fusion.pipelines.options import DEFAULT_LAYERS, DEFAULT_STRENGTH, OPTION
from qwen_image_fusion.ui.controls import option_slider, settings_controls, settings_fields
from qwen_image_fusion.ui.generation import (
    CUSTOM,
    EDIT_INPUT_NAMES,
    FROM_IMAGES,
    IMAGE_ROLES,
    NO_CROP,
    image_input_names,
    inpaints_input,
    starts_from_image,
)
from qwen_image_fusion.ui.uploads import upload_caps


@dataclass(frozen=True)
class Handlers:
    """build_app's request handlers: the validator, the run and Stop (shared by the demo's forms)."""

    validate: Callable[..., Any]
    run: Callable[..., Any]
    stop: Callable[..., Any]
    lora_key: str  # the inputs name of the preset and LoRA controls' state


def edit_tab(pipe: Any, variants: list[str], handlers: Handlers, stop_api: str | None) -> None:
    """The Edit tab and its events (call inside the Blocks layout); `stop_api` names the Stop button's API
    endpoint (None: private, when another form already offers "/stop")."""
    starts = starts_from_image(pipe)
    masks = starts or inpaints_input(pipe)  # the tab takes a mask (inpainting) and a strength
    controls = starts and getattr(pipe.spec, "takes_control", False)
    decomposes = getattr(pipe.spec, "decomposes", False)
    count = max(pipe.spec.max_images, 1)
    names = {1: "Start image" if starts else "Input image"} if count == 1 else {}
    start_inputs = {}
    title = "Image to image" if starts else "Layers" if decomposes else "Edit"
    if controls:
        title = "Image to image / ControlNet"  # a ControlNet checkpoint's tab: start image or control map
    with gr.Tabs(), gr.Tab(title, id="edit"), gr.Row():
        with gr.Column(scale=5):
            with gr.Row():
                images = [
                    gr.Image(
                        type="filepath",
                        sources=["upload", "clipboard"],
                        label=names.get(i, f"Picture {i}"),
                        height=220,
                        elem_id=f"edit_image_{i}",
                    )
                    for i in range(1, count + 1)
                ]
                if masks:
                    start_inputs["mask"] = gr.Image(
                        type="filepath",
                        sources=["upload", "clipboard"],
                        label="Mask (optional): its white part is repainted, the rest kept"
                        + ("" if starts else " (an inpainting edit, at the size the image suggests)"),
                        height=220,
                        elem_id="edit_mask",
                    )
            cost = (
                "The output takes the start image's size, scaled down to the model's default area."
                if starts
                else "The model sees each input image at about 1024×1024: in the cost limit it counts as "
                "that many more pixels per step."
            )
            gr.Markdown(f"Uploads: {upload_caps()}. {cost}", elem_id="edit_caps")
            prompt = gr.Textbox(
                "", label="Prompt" if starts else "Instruction", lines=2, elem_id="edit_prompt"
            )
            negative = gr.Textbox("", label="Negative prompt (true CFG)", lines=1, elem_id="edit_negative")
            if masks:
                start_inputs["strength"] = option_slider(
                    OPTION["strength"],
                    DEFAULT_STRENGTH,
                    "Strength" + ("" if starts else " (with a mask)"),
                    0.05,
                    elem_id="edit_strength",
                )
                start_inputs["padding_mask_crop"] = gr.Number(
                    NO_CROP,
                    precision=0,
                    minimum=NO_CROP,
                    label=f"Padding mask crop (pixels; {NO_CROP}: off): with a mask, generate only the box "
                    "around its white part, that much wider, and paste it back",
                    elem_id="edit_padding_mask_crop",
                )
            if decomposes:
                start_inputs["layers"] = option_slider(
                    OPTION["layers"], DEFAULT_LAYERS, "Layers", 1, elem_id="edit_layers"
                )
            if controls:
                start_inputs["role"] = gr.Radio(
                    list(IMAGE_ROLES),
                    value="start",
                    label="Use the image as: the start image, a control map (canny, depth, pose or soft "
                    "edge), or a photo whose canny edges guide the ControlNet",
                    elem_id="edit_role",
                )
                start_inputs["control_scale"] = option_slider(
                    OPTION["controlnet_conditioning_scale"], 1.0, "Control scale", 0.05,
                    elem_id="edit_control_scale",
                )  # fmt: skip
            with gr.Row():
                edit_btn = gr.Button("Generate" if starts else "Edit", variant="primary", elem_id="edit")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="edit_stop")
            which = "first" if count == 1 else "last"
            choice = (
                "from the start image"
                if starts
                else "from the image (about 640×640, its aspect)"
                if decomposes
                else f"from the images (about 1024×1024, the {which} image's aspect)"
            )
            size = gr.Radio(
                [(choice, FROM_IMAGES), ("custom", CUSTOM)],
                value=FROM_IMAGES,
                label="Output size",
                elem_id="edit_size",
            )
            settings = settings_controls(pipe, variants, prefix="edit_")
        with gr.Column(scale=6):
            gallery = gr.Gallery(
                label="Images" if starts else "Layers" if decomposes else "Edited",
                format="png",
                buttons=["download", "fullscreen"],
                columns=2,
                height="auto",
            )
            details = gr.Markdown("Run details appear here.", label="Details", elem_id="edit_details")

    private = {"queue": False, "api_visibility": "private"}
    for field in (settings.width, settings.height):
        field.input(lambda: CUSTOM, None, size, **private)
    triggers = [edit_btn.click, prompt.submit]
    gr.on(triggers, lambda: "", None, details, **private)
    fields = [prompt, negative, size, *settings_fields(settings)]
    inputs = (
        dict(zip(EDIT_INPUT_NAMES, fields, strict=True))
        | dict(zip(image_input_names(count), images, strict=True))
        | start_inputs
        | {handlers.lora_key: settings.lora_kwargs}
    )
    run = gr.on(
        triggers,
        handlers.run,
        inputs_kwargs=inputs,
        outputs=[gallery, settings.used_seed, details],
        api_name="edit",
        show_progress_on=gallery,
        concurrency_limit=1,
        concurrency_id="model",
        validator=handlers.validate,
        preprocess=False,  # raw values (the images' file data too) reach job_from_edit_inputs
    )
    # private under its own name, so that the other form's Stop keeps "/stop"
    private = {"api_name": "edit_stop", "api_visibility": "private"}
    stop_options = {"api_name": stop_api} if stop_api else private
    stop_btn.click(handlers.stop, None, details, cancels=[run], queue=False, **stop_options)
