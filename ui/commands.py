"""The `qwen-image` commands. Each checks everything its arguments, the checkpoint's configs and the files'
headers can tell before importing torch or loading a model, then loads and runs."""

import argparse
import dataclasses
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import PIL.Image

from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.models.family import CheckpointSpec
from qwen_image_fusion.models.memory import Workload
from qwen_image_fusion.pipelines.generation_request import GenerationRequest, resolve_request
from qwen_image_fusion.pipelines.images import MAX_INPUT_BYTES, open_input_image, read_input_images
from qwen_image_fusion.pipelines.launch_env import is_leader_process, launched_world_size
from qwen_image_fusion.pipelines.limits import check_size, check_steps
from qwen_image_fusion.pipelines.load_options import LoadOptions
from qwen_image_fusion.pipelines.memory_plan import checkpoint_plan, default_workload, parse_size
from qwen_image_fusion.pipelines.options import IMAGE, IMAGES, cli_options
from qwen_image_fusion.pipelines.presets import LoraSpec, find_lora_files, get_preset, parse_lora_spec
from qwen_image_fusion.pipelines.requests import check_requests_for, read_requests
from qwen_image_fusion.pipelines.variants import resolve_variant
from qwen_image_fusion.ui.access import check_access, is_loopback, read_accounts, read_api_keys
from qwen_image_fusion.ui.limits import Limits


def image_paths(out: Path, request: GenerationRequest) -> list[Path]:
    """Where a request's images go: `out` itself, or `out` with an index for several. The folder must
    exist."""
    count = request.outputs
    if out.suffix.lower() not in PIL.Image.registered_extensions():
        raise InputError(f"output {out} needs an image extension such as .png")
    if not out.parent.is_dir():
        raise InputError(f"output folder {out.parent} does not exist: create it first")
    return [out] if count == 1 else [out.with_stem(f"{out.stem}-{i}") for i in range(count)]


def check_model_args(args: argparse.Namespace) -> CheckpointSpec:
    """The checkpoint's configs and the variant asked for, checked without torch (argparse checks --dtype)."""
    spec = inspect_checkpoint(args.model)
    resolve_variant(args.variant, spec.weights)
    return spec


def check_device(device: str | None) -> None:
    """The device names a usable device (imports torch, nothing heavier)."""
    from qwen_image_fusion.pipelines.precision import pick_device

    pick_device(device)


def read_loras(specs: list[LoraSpec], spec: CheckpointSpec) -> list[tuple[Any, float]]:
    """Read every --lora and check each factor against the transformer's layers (built on the meta device
    from its config), so a bad file fails before the model loads."""
    if not specs:
        return []
    from qwen_image_fusion.models.lora import check_lora_fits
    from qwen_image_fusion.models.lora_files import read_lora_file

    model = spec.family.meta_transformer(spec)
    loras = []
    for each in specs:
        lora = read_lora_file(each.path, spec.family.convert_lora)
        check_lora_fits(model, lora)
        loras.append((lora, each.scale))
    return loras


def load_options(
    args: argparse.Namespace, parallel: Any = None, gpu_memory: int | None = None, workload: Any = None
) -> LoadOptions:
    """The load options the command line gives (the model, variant, device and dtype flags)."""
    return LoadOptions(args.model, args.variant, args.device, args.dtype, parallel, gpu_memory, workload)


def load(options: LoadOptions) -> Any:
    if is_leader_process():
        where = "" if options.parallel is None else f" as {options.parallel.describe()}"
        print(f"loading {options.model or 'the embedded default model'}{where} ...", file=sys.stderr)
    from qwen_image_fusion.pipelines.loading import load as load_pipeline

    return load_pipeline(options)


def memory_budget(args: argparse.Namespace) -> int | None:
    """--gpu-memory in bytes (None: what the GPU has free), checked without torch."""
    if args.gpu_memory is None:
        return None
    if getattr(args, "gpus", 1) > 1 or launched_world_size() > 1:  # `serve` has no --gpus
        raise InputError("--gpu-memory does not combine with several GPUs yet: leave out one of them")
    return parse_size(args.gpu_memory)


def gpu_memory_plan(args: argparse.Namespace, spec: CheckpointSpec, budget: int, workload: Workload) -> Any:
    """The plan `budget` gives on a CUDA GPU, where every component runs in BF16 unless --dtype fp32 (what
    the pipeline picks there), from the configs and safetensors headers only (the pipeline's own
    `checkpoint_plan`): a budget that cannot work, or a family that plans no memory, is refused here, before
    torch is imported."""
    size = 4 if args.dtype == "fp32" else 2
    return checkpoint_plan(spec, size, size, budget, workload)[1]


def request_values(args: argparse.Namespace, images: list[PIL.Image.Image]) -> dict[str, Any]:
    """The request values the command's flags give (declared in pipelines/options.py), files read: the
    input `images` (already read and checked against the model), start image, masks and control maps."""
    values: dict[str, Any] = {}
    for option, _ in cli_options(args.command):
        value = getattr(args, option.name)
        if option.name == "prompt":
            continue
        if option.name == "image":
            value = images or None
        elif option.kind == IMAGE and value is not None:
            value = open_input_image(value, MAX_INPUT_BYTES, option.name)
        elif option.kind == IMAGES and value:
            value = [open_input_image(path, MAX_INPUT_BYTES, option.name) for path in value]
        values[option.name] = value
    return values


def plan(args: argparse.Namespace, spec: CheckpointSpec, true_cfg: bool) -> Any:
    """None for one process; else the plan for `--gpus N` (checked against the model's heads and the
    visible GPUs before anything loads) or for the ranks a launcher started."""
    world = launched_world_size()
    if world == 1 and args.gpus == 1:
        return None
    from qwen_image_fusion.pipelines.parallel import check_supported, plan_for

    if world > 1 and args.gpus not in (1, world):
        raise InputError(f"--gpus {args.gpus}, but the launcher started {world} ranks")
    chosen = plan_for(max(world, args.gpus), spec.attention_heads, true_cfg)
    check_supported(chosen, spec)
    if world == 1:
        check_gpus_visible(args.gpus, args.device)
    return chosen


def check_gpus_visible(gpus: int, device: str | None) -> None:
    import torch

    if device is not None and device.startswith("cpu"):
        raise InputError(
            "--gpus starts one rank per GPU; for gloo ranks on the CPU run "
            "`torchrun --nproc_per_node N -m qwen_image_fusion.ui.cli ... --device cpu`"
        )
    visible = torch.cuda.device_count()
    if visible < gpus:
        raise InputError(f"--gpus {gpus}, but {visible} CUDA GPUs are visible on this machine")


def launch(args: argparse.Namespace, chosen: Any) -> None:
    """Start the ranks of `chosen`, each running this same command line (ui/launch.py)."""
    from qwen_image_fusion.ui.launch import launch_ranks

    print(f"starting {chosen.describe()}", file=sys.stderr)
    launch_ranks(chosen.world_size, [sys.executable, "-m", "qwen_image_fusion.ui.cli", *args.argv])


def cmd_generate(args: argparse.Namespace) -> None:
    spec = check_model_args(args)
    if spec.images_required and not args.image:
        raise InputError(
            f"{spec.name} edits images and cannot generate from text alone: "
            "run `qwen-image edit INSTRUCTION --image FILE` with it"
        )
    images = read_input_images(args.image or [], spec.max_images, spec.images_required, spec.name)
    run_generation(args, spec, images)


def cmd_edit(args: argparse.Namespace) -> None:
    spec = check_model_args(args)
    if spec.max_images == 0:
        raise InputError(
            f"{spec.name} generates from text only and cannot edit images: give `qwen-image edit` a "
            "Qwen-Image-Edit checkpoint (its model_index.json names QwenImageEditPipeline or "
            "QwenImageEditPlusPipeline)"
        )
    images = read_input_images(args.image, spec.max_images, spec.images_required, spec.name)
    run_generation(args, spec, images)


def cmd_layers(args: argparse.Namespace) -> None:
    spec = check_model_args(args)
    if not spec.decomposes:
        raise InputError(
            f"{spec.name} does not decompose images into layers: give `qwen-image layers` a "
            "Qwen-Image-Layered checkpoint (its model_index.json names QwenImageLayeredPipeline)"
        )
    images = read_input_images([args.image], spec.max_images, spec.images_required, spec.name)
    run_generation(args, spec, images, layer_paths)


def layer_paths(out: Path, request: GenerationRequest) -> list[Path]:
    """Where a request's layers go, `request.layers` per image: `out/layer-J.png`, or
    `out/image-I-layer-J.png` for several images. `out` may be new; its parent must exist, and it must not
    be a file."""
    if (out.exists() and not out.is_dir()) or not out.parent.is_dir():
        raise InputError(f"output {out} must be a folder whose parent exists")
    count, layers = request.outputs, request.layers
    if count == layers:
        return [out / f"layer-{j}.png" for j in range(layers)]
    return [out / f"image-{i}-layer-{j}.png" for i in range(count // layers) for j in range(layers)]


def run_generation(
    args: argparse.Namespace,
    spec: CheckpointSpec,
    images: list[PIL.Image.Image],
    outputs: Callable[[Path, GenerationRequest], list[Path]] = image_paths,
) -> None:
    """`generate`, `edit` (with input `images`) and `layers` (writing `outputs`): the request resolved and
    checked, the ranks started when asked (each reads the image files itself), then the model loaded and the
    request run. Before loading, the checkpoint's default size stands in for the size input images suggest
    (the loaded model's)."""
    values = request_values(args, images)
    checked = resolve_request(spec, args.prompt, **values)
    outputs(Path(args.out), checked)
    budget = memory_budget(args)
    workload = checked.workload()
    if budget is not None and not (args.device or "cuda").startswith("cpu"):
        gpu_memory_plan(args, spec, budget, workload)
    lora_specs = [parse_lora_spec(text) for text in args.lora or []]
    chosen = plan(args, spec, checked.true_cfg)
    if chosen is not None and launched_world_size() == 1:
        launch(args, chosen)
        return
    check_device(args.device)
    loras = read_loras(lora_specs, spec)
    pipe = load(load_options(args, chosen, budget, workload))
    for lora_file, scale in loras:
        pipe.load_lora(lora_file, scale)
    pipe.set_lora_mode(args.lora_mode)
    request = pipe.request(args.prompt, **values)
    [result] = pipe.run([request], progress=is_leader_process())
    if not is_leader_process():
        return
    paths = outputs(Path(args.out), request)
    paths[0].parent.mkdir(exist_ok=True)
    for image, path in zip(result.images, paths, strict=True):
        save_image(image, path)
    print_run(pipe, paths)


def save_image(image: PIL.Image.Image, path: Path) -> None:
    """Save `image`; an RGBA image (Qwen-Image 2.1 decodes four channels) in a format without alpha, such
    as JPEG, is saved as its RGB channels, with a warning."""
    try:
        image.save(path)
    except OSError:
        if image.mode != "RGBA":
            raise
        print(f"warning: {path.suffix} stores no alpha: {path} holds the RGB channels", file=sys.stderr)
        image.convert("RGB").save(path)


def print_run(pipe: Any, paths: list[Path]) -> None:
    """The run summary: files, size, seed, variant and precision, seconds per stage, fusion, plan, LoRAs."""
    run = pipe.last_run
    t = run.timings
    print(
        f"wrote {', '.join(map(str, paths))} "
        f"({run.width}x{run.height}, seed {run.seed}, variant {run.variant}, {pipe.precision.describe()})"
    )
    images = f"image encoding {t['image_encoding']:.2f} s | " if "image_encoding" in t else ""
    print(
        f"text encoding {t['text_encoding']:.2f} s | {images}denoising {t['denoising']:.2f} s "
        f"({run.ms_per_step:.0f} ms/step x {run.num_inference_steps}) | decoding {t['decoding']:.2f} s "
        f"| total {t['total']:.2f} s"
    )
    if run.caption:
        print(f"caption (the model's, for the empty prompt): {run.caption}")
    print(run.fusion_summary)
    print(f"parallel: {pipe.parallel_summary()}")
    if pipe.memory is not None and not pipe.memory.plan.resident:
        print(f"memory: {pipe.memory.plan.summary()}")
    if run.preset:
        print(f"preset: {get_preset(run.preset).describe()}")
    for label, text in run.approximations().items():
        print(f"{label.lower()}: {text}")
    if run.loras:
        print(run.loras)
    if pipe.lora_merge is not None:
        print(pipe.lora_merge.summary())


def cmd_info(args: argparse.Namespace) -> None:
    spec = check_model_args(args)
    budget = memory_budget(args)
    if budget is not None:  # the plan for a CUDA GPU, from the configs: printed even where there is none
        plan = gpu_memory_plan(args, spec, budget, default_workload(spec))
        print("\n".join(plan.describe()), flush=True)
    check_device(args.device)
    from qwen_image_fusion.pipelines.info import describe, describe_plans
    from qwen_image_fusion.pipelines.precision import pick_device

    plans = describe_plans(args.gpus, spec) if args.gpus > 1 else None
    on_gpu = pick_device(args.device).type == "cuda"
    print(describe(load(load_options(args, gpu_memory=budget if on_gpu else None))))
    if plans:
        print(plans)


def cmd_quantize(args: argparse.Namespace) -> None:
    spec = inspect_checkpoint(args.model)
    if spec.weights is not WeightFormat.BF16:
        raise InputError(
            f"{spec.name} is already an {spec.weights.name} checkpoint: quantize its BF16 source"
        )
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"output {out} exists and is not an empty directory")
    if args.steps is not None:
        check_steps(args.steps)
    if args.size is not None:
        check_size(args.size, args.size, spec.size_multiple)
    get_preset(args.preset, spec.family.name)
    prompts = None if args.calib_prompts is None else read_requests(Path(args.calib_prompts))
    if prompts is not None:
        check_requests_for(prompts, spec)
        for request in prompts:
            for path in request.files:
                open_input_image(path)
    ignore = None if args.keep_bf16 is None else tuple(filter(None, args.keep_bf16.split(",")))
    lora_specs = [parse_lora_spec(text) for text in args.lora or []]
    check_device(args.device)
    loras = read_loras(lora_specs, spec)
    from qwen_image_fusion.pipelines.quantize import quantize_checkpoint

    written = quantize_checkpoint(
        args.model,
        out,
        prompts,
        ignore,
        steps=args.steps,
        size=args.size,
        device=args.device,
        loras=loras,
        preset=args.preset,
        fp8_modulation=args.fp8_modulation,
        weights=args.format,
    )
    print(f"wrote {written}")
    print(f"check it with: qwen-image info --model {written}")


def ui_accounts(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The accounts `qwen-image ui` requires (ui/access.py's rule): refused here, before anything loads."""
    accounts = list(args.auth or []) + (read_accounts(args.auth_file) if args.auth_file else [])
    how = "--auth USER:PASS (or --auth-file FILE)"
    warning = check_access(
        args.host, args.port, "the demo", len(accounts), args.no_auth, "--auth/--auth-file", how
    )
    if warning and is_leader_process():
        print(f"warning: {warning}", file=sys.stderr)
    return accounts


def cmd_ui(args: argparse.Namespace) -> None:
    accounts = ui_accounts(args)  # an open address is refused before anything loads or any rank starts
    spec = check_model_args(args)
    budget = memory_budget(args)
    workload = ui_workload(spec)
    if budget is not None and not (args.device or "cuda").startswith("cpu"):
        gpu_memory_plan(args, spec, budget, workload)
    lora_files = None if args.lora_dir is None else find_lora_files(Path(args.lora_dir))
    chosen = plan(args, spec, true_cfg=True)
    if chosen is not None and launched_world_size() == 1:
        launch(args, chosen)
        return
    check_device(args.device)
    from qwen_image_fusion.ui.app import launch as launch_app

    if is_leader_process():
        print(f"loading {args.model or 'the embedded default model'} ...", file=sys.stderr)
    limits = limit_overrides(args)
    launch_app(
        load_options(args, chosen, budget, workload),
        host=args.host,
        port=args.port,
        lora_files=lora_files,
        limits=limits,
        auth=accounts or None,
        on_start=lambda port, applied: print(
            serving_message(args.host, port, len(accounts), applied), flush=True
        ),
    )


def ui_workload(spec: CheckpointSpec) -> Workload:
    """The request the demo's memory plan holds: its largest aspect preset (or the model's default size),
    one image, true CFG, the input images of `default_workload`, a step cache's buffers (the demo and the
    server offer one); a larger request is refused with the reason when it would not fit."""
    from qwen_image_fusion.ui.generation import ASPECT_RATIOS

    sizes = [*ASPECT_RATIOS.values(), (spec.defaults.width, spec.defaults.height)]
    width, height = max(sizes, key=lambda size: size[0] * size[1])
    return Workload(width, height, input_images=default_workload(spec).input_images, step_cache=True)


def serve_workload(spec: CheckpointSpec, max_batch: int) -> Workload:
    """The request `serve --max-batch` plans for: a full batch of `ui_workload`, its prompts encoded in one
    call where the family shares text encoding."""
    prompts = max_batch if spec.shares_text_encoding else 1
    return dataclasses.replace(ui_workload(spec), images=max_batch, prompts=prompts)


def limit_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The Limits fields the command line sets (None: the device's default)."""
    names = {
        "max_work": "max_work",
        "time_limit_s": "time_limit",
        "queue_size": "queue_size",
        "jobs_per_client": "jobs_per_client",
        "keep_images_minutes": "keep_images",
        "max_body_mb": "max_body_mb",
        "max_upload_mb": "max_upload_mb",
        "cache_mb": "cache_mb",
    }
    return {field: getattr(args, flag) for field, flag in names.items() if hasattr(args, flag)}


def check_listen(host: str, port: int) -> None:
    """InputError unless this process can listen on host:port now (so a taken port fails before loading)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        raise InputError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def cmd_serve(args: argparse.Namespace) -> None:
    keys = read_api_keys(args.api_key_file) if args.api_key_file else []
    how = "--api-key-file FILE (one key per line)"
    warning = check_access(args.host, args.port, "the API", len(keys), args.no_auth, "--api-key-file", how)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    check_listen(args.host, args.port)
    spec = check_model_args(args)
    budget = memory_budget(args)
    workload = serve_workload(spec, args.max_batch)
    if budget is not None and not (args.device or "cuda").startswith("cpu"):
        gpu_memory_plan(args, spec, budget, workload)
    lora_files = None if args.lora_dir is None else find_lora_files(Path(args.lora_dir))
    check_device(args.device)
    from qwen_image_fusion.ui.server import serve

    print(f"loading {args.model or 'the embedded default model'} ...", file=sys.stderr)
    serve(
        load_options(args, gpu_memory=budget, workload=workload),
        args.host,
        args.port,
        lora_files=lora_files,
        limits=limit_overrides(args),
        keys=keys,
        ui=args.ui,
        max_batch=args.max_batch,
        window_s=args.batch_window_ms / 1000,
        on_start=lambda port, applied, slots, memory: print(
            api_serving_message(args.host, port, len(keys), applied, args.ui, slots, memory), flush=True
        ),
    )


def api_serving_message(
    host: str, port: int, keys: int, limits: Limits, ui: bool, batch: str, memory: str = ""
) -> str:
    """What the console says once the server is up: where, the keys, how to serve others, limits, batching
    and the memory plan (when it keeps weights off the device)."""
    url = _url(host, port)
    lines = [f"Qwen-Image API on {url}/v1{_wildcard(host, port)} (Ctrl+C stops it)."]
    if ui:
        lines.append(f"Web demo on {url}/ui/, on the same queue.")
    if keys:
        lines.append(f"API keys required: {keys} (Authorization: Bearer KEY).")
    if is_loopback(host):
        lines.append(
            "Only this machine can reach it. To serve others: qwen-image serve --host 0.0.0.0 "
            "--api-key-file FILE; see qwen-image serve --help."
        )
    lines.append(
        f"Limits: {limits.max_work:g} megapixel-steps and {limits.time_limit_s:g} s per request, "
        f"{limits.queue_size} waiting. Batching: {batch}."
    )
    if memory:
        lines.append(f"Memory: {memory}.")
    return "\n".join(lines)


def _url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _wildcard(host: str, port: int) -> str:
    return (
        f": every address of this machine, http://127.0.0.1:{port} here" if host in ("0.0.0.0", "::") else ""
    )


def serving_message(host: str, port: int, accounts: int, limits: Limits) -> str:
    """What the console says once the demo is up: where, who may sign in, how to serve others, limits."""
    lines = [f"Qwen-Image demo on {_url(host, port)}{_wildcard(host, port)} (Ctrl+C stops it)."]
    if accounts:
        lines.append(f"Sign-in required: {accounts} account{'s' if accounts > 1 else ''}.")
    if is_loopback(host):
        lines.append(
            "Only this machine can open it. To serve others: qwen-image ui --host 0.0.0.0 --auth USER:PASS "
            "(or --auth-file FILE); see qwen-image ui --help."
        )
    lines.append(
        f"Limits: {limits.max_work:g} megapixel-steps and {limits.time_limit_s:g} s per request, "
        f"{limits.queue_size} waiting, {limits.jobs_per_client} per client."
    )
    return "\n".join(lines)


COMMANDS = {
    "generate": cmd_generate,
    "edit": cmd_edit,
    "layers": cmd_layers,
    "info": cmd_info,
    "quantize": cmd_quantize,
    "ui": cmd_ui,
    "serve": cmd_serve,
}
