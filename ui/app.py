"""Gradio demo: prompt in, images out, with per-stage timings and the fused FP8 paths that ran.

One model per process; requests queue and run one at a time on the GPU. The generate event has
the stable API name "/generate" (see ui/README.md for a gradio_client snippet).
"""

from pathlib import Path

import gradio as gr
import torch
from PIL import Image

from models.embedded import EMBEDDED_NAME
from models.errors import QwenImageError
from pipelines import load_pipeline
from pipelines.limits import MAX_STEPS, MIN_STEPS
from pipelines.parallel import ParallelPlan
from ui.generation import (
    CUSTOM,
    PRESETS,
    VARIANT_LABELS,
    Cancelled,
    Pipeline,
    Runner,
    format_details,
    preset_for,
    resolve_size,
)
from ui.lora_controls import load_lora_files, lora_controls, lora_details
from ui.ranks import serve

QUEUE_MAX = 64
GALLERY_MAX_IMAGES = 4
EXAMPLES = [
    "A red apple on a wooden table, soft window light",
    "A foggy mountain lake at sunrise with a small rowing boat",
    'A neon sign above a noodle bar that reads "OPEN LATE", rainy night street',
    "一只戴着围巾的橘猫坐在书店门口，招牌上写着“猫咪书店”",
    "Isometric illustration of a tiny greenhouse full of succulents, pastel colors",
]


def build_app(pipe: Pipeline) -> gr.Blocks:
    """The demo around an already loaded pipeline (variants switch in place on its weights)."""
    runner = Runner(pipe)
    defaults = pipe.defaults
    default_aspect = preset_for(defaults.width, defaults.height)
    variants = pipe.available_variants()

    def generate(
        prompt: str,
        negative_prompt: str,
        aspect: str,
        width: float | None,
        height: float | None,
        num_inference_steps: float,
        true_cfg_scale: float,
        seed: float | None,
        randomize_seed: bool,
        num_images: float,
        variant: str,
        lora_kwargs: dict,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio injects the tracker by this default)
    ) -> tuple[list[Image.Image], int, str]:
        """Run one request; returns (images, seed used, details markdown)."""
        w, h = resolve_size(aspect, width, height)

        def on_step(step: int, total: int) -> None:
            progress((step, total), desc="Decoding" if step == total else "Denoising", unit="steps")

        progress(0, desc="Encoding the prompt")
        try:
            images, run = runner.run(
                request.session_hash,
                variant,
                on_step,
                prompt=prompt,
                negative_prompt=negative_prompt or None,
                width=w,
                height=h,
                num_inference_steps=int(num_inference_steps),
                true_cfg_scale=float(true_cfg_scale),
                seed=None if randomize_seed or seed is None else int(seed),
                num_images_per_prompt=int(num_images),
                **lora_kwargs,
            )
        except QwenImageError as e:
            raise gr.Error(str(e), print_exception=False) from e
        except Cancelled as e:
            raise gr.Error("Stopped.", print_exception=False) from e
        except torch.OutOfMemoryError as e:
            torch.cuda.empty_cache()  # hand the failed run's blocks back so the next request can fit
            msg = f"Out of GPU memory at {w}x{h} x{int(num_images)}: try a smaller size or fewer images."
            raise gr.Error(msg, print_exception=False) from e
        return images, run.seed, format_details(run) + lora_details(run)

    def stop(request: gr.Request) -> None:
        """Stop this session's running generation at its next step (the Stop button, or "/stop")."""
        runner.stop(request.session_hash)

    with gr.Blocks(title="Qwen-Image", analytics_enabled=False) as demo:
        gr.Markdown(_header(pipe))
        with gr.Row():
            with gr.Column(scale=5):
                prompt = gr.Textbox("", label="Prompt", lines=3, elem_id="prompt")
                negative = gr.Textbox("", label="Negative prompt (true CFG)", lines=1, elem_id="negative")
                with gr.Row():
                    generate_btn = gr.Button("Generate", variant="primary", elem_id="generate")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                aspect = gr.Radio(
                    [(f"{name} · {w}×{h}", name) for name, (w, h) in PRESETS.items()] + [("custom", CUSTOM)],
                    value=default_aspect,
                    label="Aspect ratio",
                    elem_id="aspect",
                )
                with gr.Row():
                    width = gr.Number(defaults.width, label="Width", precision=0, elem_id="width")
                    height = gr.Number(defaults.height, label="Height", precision=0, elem_id="height")
                with gr.Row():
                    steps = gr.Slider(
                        MIN_STEPS,
                        MAX_STEPS,
                        defaults.num_inference_steps,
                        step=1,
                        label="Steps",
                        elem_id="steps",
                    )
                    cfg = gr.Slider(1.0, 10.0, defaults.true_cfg_scale, step=0.1, label="True CFG scale")
                with gr.Row():
                    seed = gr.Number(0, label="Seed", precision=0, minimum=0, elem_id="seed")
                    randomize = gr.Checkbox(True, label="Randomize seed")
                    num_images = gr.Slider(1, GALLERY_MAX_IMAGES, 1, step=1, label="Images")
                variant = gr.Dropdown(
                    [(VARIANT_LABELS.get(v, v), v) for v in variants],
                    value=pipe.variant,
                    label="Pipeline variant",
                    visible=len(variants) > 1,
                )
                lora_kwargs = lora_controls(pipe, steps, cfg)
            with gr.Column(scale=6):
                gallery = gr.Gallery(
                    label="Images",
                    format="png",
                    buttons=["download", "fullscreen"],
                    columns=2,
                    height="auto",
                    elem_id="gallery",
                )
                details = gr.Markdown("Run details appear here.", label="Details", elem_id="details")
        gr.Examples([[p] for p in EXAMPLES], inputs=[prompt], label="Example prompts")

        private = {"queue": False, "api_visibility": "private"}
        aspect.input(_fill_size, [aspect, width, height], [width, height], **private)
        for field in (width, height):
            field.input(lambda: CUSTOM, None, aspect, **private)
        inputs = [
            *(prompt, negative, aspect, width, height, steps, cfg, seed, randomize, num_images, variant),
            lora_kwargs,
        ]
        run = gr.on(
            [generate_btn.click, prompt.submit],
            generate,
            inputs,
            [gallery, seed, details],
            api_name="generate",
            show_progress_on=gallery,
            concurrency_limit=1,
        )
        stop_btn.click(stop, None, None, cancels=[run], queue=False, api_name="stop")
    return demo.queue(max_size=QUEUE_MAX)


def launch(
    model: str | None,
    host: str,
    port: int,
    variant: str = "auto",
    device: str | None = None,
    dtype: str | None = None,
    parallel: ParallelPlan | None = None,
    lora_files: list[Path] | None = None,
) -> None:
    """Load the model once and serve the demo until interrupted (entry point of `qwen-image ui`); with a
    parallel plan, rank 0 serves and the other ranks follow its jobs (ui/ranks.py). `lora_files` are
    mounted at scale 0 (on every rank) for the LoRA sliders."""
    pipe = load_pipeline(model=model, variant=variant, device=device, dtype=dtype, parallel=parallel)
    if lora_files is not None:
        load_lora_files(pipe, lora_files)
    serve(pipe, lambda app_pipe: build_app(app_pipe).launch(server_name=host, server_port=port))


def _header(pipe: Pipeline) -> str:
    note = " (built-in tiny random weights: its images are noise)" if pipe.model_name == EMBEDDED_NAME else ""
    return f"# Qwen-Image\nModel `{pipe.model_name}`{note} on `{pipe.device}`."


def _fill_size(aspect: str, width: float | None, height: float | None) -> tuple[float | None, float | None]:
    """A preset's size for the width/height fields; "custom" keeps what they hold."""
    return PRESETS.get(aspect, (width, height))
