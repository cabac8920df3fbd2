"""Gradio demo: prompt in, images out, with per-stage timings and the fused FP8 paths that ran.

One model per process; requests queue (bounded, one per browser tab or API client by default) and run
one at a time. Every request is checked when it arrives, before it queues (its values and its cost
against the cap); a running one stops within one denoising step on Stop, a cancelled or disconnected
client, or the time limit. The generate event has the stable API name "/generate" (ui/README.md).
"""

import asyncio
import contextvars
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gradio as gr
import torch
from PIL import Image

from qwen_image_fusion.models.embedded import EMBEDDED_NAME
from qwen_image_fusion.models.errors import InputError, QwenImageError
from qwen_image_fusion.pipelines import loading
from qwen_image_fusion.pipelines.load_options import LoadOptions
from qwen_image_fusion.pipelines.presets import load_lora_files
from qwen_image_fusion.ui.controls import settings_controls, settings_fields
from qwen_image_fusion.ui.edit_tab import Handlers, edit_tab
from qwen_image_fusion.ui.generation import (
    CUSTOM,
    INPUT_NAMES,
    FieldError,
    Pipeline,
    aspect_ratios,
    check_work,
    format_details,
    job_from_edit_inputs,
    job_from_inputs,
    preset_for,
    seed_note,
    starts_from_image,
)
from qwen_image_fusion.ui.limits import Limits
from qwen_image_fusion.ui.lora_controls import lora_details
from qwen_image_fusion.ui.ranks import serve
from qwen_image_fusion.ui.runner import CANCELLED, DISCONNECTED, STOP_PRESSED, Job, Runner, Stopped
from qwen_image_fusion.ui.uploads import upload_options

LORA_KWARGS = "lora_kwargs"  # the preset and LoRA controls' generate() arguments, beside INPUT_NAMES
EDIT_SIZE = "size"  # the edit form's size choice (EDIT_INPUT_NAMES): it marks an /edit request
EMBEDDED_EXAMPLES = [  # scenes the embedded default was trained on (eval/scenes.py): colours at positions
    "a red circle on the left and a blue square on the right",
    "two green triangles at the top, black background",
    "a yellow star in the center on a gray background",
    "左边有一个红色圆形，右边有一个蓝色正方形，白色背景。",
    "an orange cross at the bottom and a purple circle at the top, beige background",
]
EXAMPLES = [  # for a real Qwen-Image checkpoint
    "A red apple on a wooden table, soft window light",
    "A foggy mountain lake at sunrise with a small rowing boat",
    'A neon sign above a noodle bar that reads "OPEN LATE", rainy night street',
    "一只戴着围巾的橘猫坐在书店门口，招牌上写着“猫咪书店”",
    "Isometric illustration of a tiny greenhouse full of succulents, pastel colors",
]


def build_app(pipe: Pipeline, limits: Limits | None = None, runner: Runner | None = None) -> gr.Blocks:
    """The demo around an already loaded pipeline (variants switch in place on its weights).

    `limits` default to the pipeline's device type (Limits.for_device); `runner` to one Runner on `pipe`
    (the HTTP server passes its own, so the page and the API share one queue).
    """
    limits = limits or Limits.for_device(torch.device(pipe.device).type)
    runner = runner or Runner(pipe, limits)
    defaults = pipe.defaults
    presets = aspect_ratios(pipe.size_multiple)  # a preset's size for the width/height fields
    variants = pipe.available_variants()
    keep_s = max(1, round(limits.keep_images_minutes * 60))
    delete_cache = (max(1, min(60, keep_s // 2)), keep_s)  # (every, older than) seconds

    def admit(values: dict[str, Any], session: str | None) -> Job:
        """The checked job for one request's values: a /generate request (INPUT_NAMES) or an /edit one
        (EDIT_INPUT_NAMES, whose "size" replaces "aspect", and the image inputs); with the preset and LoRA
        controls' state."""
        extra = values.get(LORA_KWARGS) or {}
        if EDIT_SIZE in values:
            job = job_from_edit_inputs(session, values, pipe, demo.upload_file_set, extra)
        else:
            job = job_from_inputs(session, values, pipe, extra)
        check_work(job, limits)
        return job

    def validate(request: gr.Request, **values: Any) -> list[dict[str, Any]]:
        """Gradio's validator: runs as a request arrives, so a refused one never takes a queue place."""
        try:
            admit(values, request.session_hash)
            pending = _pending_requests(demo, request.session_hash)
            if pending >= limits.jobs_per_client:
                raise FieldError(
                    "prompt",
                    f"You already have {pending} request{'s' if pending > 1 else ''} waiting or running, "
                    f"and this server takes {limits.jobs_per_client} per browser tab or API client: "
                    "wait for it or press Stop.",
                )
        except FieldError as err:
            return [gr.validate(name != err.field, str(err) * (name == err.field)) for name in values]
        return [gr.validate(True, "") for _ in values]

    async def generate(
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio injects the tracker by this default)
        **values: Any,
    ) -> tuple[Any, Any, str]:
        """Run one request (its values by INPUT_NAMES); returns (images, seed used, details markdown)."""
        try:
            job = admit(values, request.session_hash)
        except InputError as err:
            raise gr.Error(str(err), print_exception=False) from None

        context = contextvars.copy_context()  # Gradio finds this request's progress bar through it

        def on_step(step: int, total: int) -> None:  # called on the runner's worker thread
            desc = "Decoding" if step == total else "Denoising"
            context.run(progress, (step, total), desc=desc, unit="steps")

        progress(0, desc="Encoding the prompt")
        try:
            images, run = await _run(runner, job, on_step)
        except Stopped as stopped:
            if stopped.by_user:  # a result, not an error: the page shows it in the details
                return [], job.request.seed, str(stopped)
            raise gr.Error(str(stopped), print_exception=False) from None
        except QwenImageError as err:
            raise gr.Error(str(err), print_exception=False) from None
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()  # hand the failed run's blocks back so the next request can fit
            r = job.request
            msg = f"Out of GPU memory at {r.width}x{r.height} x{r.num_images_per_prompt}: "
            raise gr.Error(msg + "try a smaller size or fewer images.", print_exception=False) from None
        return images, run.seed, seed_note(job) + format_details(run) + lora_details(run)

    def stop(request: gr.Request) -> Any:
        """Stop this client's running generation (the Stop button, or "/stop") and answer at once with where
        it stopped; the device drops the job after its current step. A request still queued is the page's
        to cancel."""
        stopped = [job for job in runner.stop_session(request.session_hash, STOP_PRESSED) if job.stopped]
        return str(stopped[0].future.exception()) if stopped else gr.skip()

    def closed(request: gr.Request) -> None:
        """The page was closed or the client went away: stop what it left running."""
        runner.stop_session(request.session_hash, DISCONNECTED)

    edits, generates = takes_images(pipe)
    with gr.Blocks(title="Qwen-Image", analytics_enabled=False, delete_cache=delete_cache) as demo:
        gr.Markdown(_header(pipe, limits))
        if edits:
            edit_tab(
                pipe, variants, Handlers(validate, generate, stop, LORA_KWARGS), None if generates else "stop"
            )
        with gr.Row(visible=generates, elem_id="generate_form"):  # a model that needs input images only edits
            with gr.Column(scale=5):
                prompt = gr.Textbox("", label="Prompt", lines=3, elem_id="prompt")
                negative = gr.Textbox("", label="Negative prompt (true CFG)", lines=1, elem_id="negative")
                with gr.Row():
                    generate_btn = gr.Button("Generate", variant="primary", elem_id="generate")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                aspect = gr.Radio(
                    [(f"{name} · {w}×{h}", name) for name, (w, h) in presets.items()] + [("custom", CUSTOM)],
                    value=preset_for(defaults.width, defaults.height, pipe.size_multiple),
                    label="Aspect ratio",
                    elem_id="aspect",
                )
                settings = settings_controls(pipe, variants)
                width, height = settings.width, settings.height
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
        examples = EMBEDDED_EXAMPLES if pipe.model_name == EMBEDDED_NAME else EXAMPLES
        gr.Examples([[p] for p in examples], inputs=[prompt], label="Example prompts", visible=generates)

        private = {"queue": False, "api_visibility": "private"}
        aspect.input(
            lambda name, w, h: presets.get(name, (w, h)), [aspect, width, height], [width, height], **private
        )
        for field in (width, height):
            field.input(lambda: CUSTOM, None, aspect, **private)
        triggers = [generate_btn.click, prompt.submit]
        gr.on(triggers, lambda: "", None, details, **private)  # a new request's details replace the last
        fields = [prompt, negative, aspect, *settings_fields(settings)]
        # By name: INPUT_NAMES are the API's parameters; the controls' state is not one (a gr.State).
        inputs = dict(zip(INPUT_NAMES, fields, strict=True)) | {LORA_KWARGS: settings.lora_kwargs}
        run = gr.on(
            triggers,
            generate,
            inputs_kwargs=inputs,
            outputs=[gallery, settings.used_seed, details],
            api_name="generate",
            api_visibility="public" if generates else "private",
            show_progress_on=gallery,
            concurrency_limit=1,
            concurrency_id="model",
            validator=validate,
            preprocess=False,  # raw values reach job_from_inputs, which checks each one
        )
        # Gradio's cancel drops a request still waiting in the queue (the page does not cancel a running
        # one); stop() ends a running one and reports it.
        stop_options = {"api_name": "stop"} if generates else {"api_visibility": "private"}
        stop_btn.click(stop, None, details, cancels=[run], queue=False, **stop_options)
        demo.unload(closed)
    _sweep_safe_file_sets(demo)
    return demo.queue(max_size=limits.queue_size, default_concurrency_limit=1)


class SweepSafeSet(set):
    """A set of cached file paths whose iteration walks a copy, taken in one step under the GIL."""

    def __iter__(self) -> Iterator[str]:
        return iter(self.copy())


def _sweep_safe_file_sets(demo: gr.Blocks) -> None:
    """Make Gradio's cache sweep survive requests that land while it runs.

    The sweep (`delete_cache`; gradio 6.31's route_utils.delete_files_created_by_app) walks each component's
    live set of cached files on a worker thread while requests add to it: the first overlap raises "Set
    changed size during iteration", which ends the sweep for the life of the server, and from then on every
    image stays on disk (seen in CI: the soak test's cache grew to 32 files, 11.8 s old, against a 3 s
    limit). Every set becomes a SweepSafeSet, the components' and the uploads' alike.
    """
    safe = {id(files): SweepSafeSet(files) for files in demo.temp_file_sets}
    for block in demo.blocks.values():
        files = getattr(block, "temp_files", None)
        if id(files) in safe:
            block.temp_files = safe[id(files)]
    demo.upload_file_set = safe[id(demo.upload_file_set)]
    demo.temp_file_sets = list(safe.values())


async def _run(
    runner: Runner, job: Job, on_step: Callable[[int, int], None]
) -> tuple[list[Image.Image], Any]:
    """The job through the runner's queue. Gradio cancels this task on a client's cancel: the job stops at
    once (the runner drops it after the running step, and runs one job or batch at a time)."""
    job.on_step = on_step
    try:
        return await asyncio.wrap_future(runner.submit(job))
    except asyncio.CancelledError:
        job.stop(CANCELLED)
        raise


def takes_images(pipe: Pipeline) -> tuple[bool, bool]:
    """(edits, generates): whether the model takes input images (or starts from one), and whether it runs
    without them."""
    spec = getattr(pipe, "spec", None)  # a pipeline without a spec (tests' fakes) generates from text
    edits = spec is not None and (spec.max_images > 0 or starts_from_image(pipe))
    return edits, (spec is None or not spec.images_required)


def _pending_requests(demo: gr.Blocks, session: str | None) -> int:
    """Requests of `session` waiting in Gradio's queue or running. Gradio keeps this per session for its
    own bookkeeping but offers no per-session limit, so the validator reads it."""
    return len(demo._queue.pending_event_ids_session.get(session, ()))


def launch(
    options: LoadOptions,
    host: str,
    port: int,
    lora_files: list[Path] | None = None,
    limits: dict[str, Any] | None = None,
    auth: list[tuple[str, str]] | None = None,
    on_start: Callable[[int, Limits], None] | None = None,
) -> None:
    """Load the model once and serve the demo until interrupted (entry point of `qwen-image ui`).

    With a parallel plan (`options.parallel`), rank 0 serves and the other ranks follow its jobs
    (ui/ranks.py). `lora_files` are mounted at scale 0 (on every rank) for the LoRA sliders. `limits`:
    Limits fields to override on the device's defaults; `auth`: (user, password) accounts;
    `on_start(port, limits)` runs once the page is up. Gradio's share link stays off whatever the
    environment says (GRADIO_SHARE), and so does its MCP server; uploads are refused above 1 kB, except the
    Edit tab's images (ui/uploads.py).
    """
    pipe = loading.load(options)
    if lora_files is not None:
        load_lora_files(pipe, lora_files)
    applied = Limits.for_device(torch.device(pipe.device).type, **(limits or {}))

    def run_app(app_pipe: Pipeline) -> None:
        demo = build_app(app_pipe, applied)
        demo.launch(
            server_name=host,
            server_port=port,
            auth=auth or None,
            share=False,
            mcp_server=False,
            quiet=True,
            prevent_thread_lock=True,
            **upload_options(takes_images(app_pipe)[0]),
        )
        if on_start is not None:
            on_start(demo.server_port, applied)
        demo.block_thread()

    serve(pipe, run_app)


def _header(pipe: Pipeline, limits: Limits) -> str:
    note = (
        " (built in: a small Qwen-Image trained on drawn scenes - coloured shapes at named positions)"
        if pipe.model_name == EMBEDDED_NAME
        else ""
    )
    return (
        f"# Qwen-Image\nModel `{pipe.model_name}`{note} on `{pipe.device}`, {pipe.parallel_summary()}.  \n"
        f"{limits.describe()}"
    )
