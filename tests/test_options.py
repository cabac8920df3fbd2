"""Every request option is declared once (pipelines/options.py), and each front end that claims it is built
from that declaration: `generate()`'s signature, the CLI flags of generate/edit/layers, the HTTP bodies'
schema, the demo's controls and the eval worker's keys and flags. An InputError names the option it
concerns (set where the check is made), and each front end names its own input for it; unknown names are
refused by name everywhere."""

import argparse
import inspect
import math
from dataclasses import replace

import gradio as gr
import pytest
from PIL import Image
from test_ui_app import FakePipe

from qwen_image_fusion.eval.worker import PER_WORKER, PROTOCOL_KEYS, request_values
from qwen_image_fusion.eval.worker import build_parser as worker_parser
from qwen_image_fusion.models.errors import InputError
from qwen_image_fusion.models.families import inspect_checkpoint
from qwen_image_fusion.pipelines.generation_request import resolve_request
from qwen_image_fusion.pipelines.options import (
    CHOICE,
    CLI_COMMANDS,
    EDITS,
    FLAG,
    FROM_MODEL,
    GENERATE,
    GENERATIONS,
    IMAGES,
    NUMBER,
    NUMBERS,
    OPTION,
    OPTIONS,
    REQUIRED,
    WHOLE,
    cli_options,
    http_options,
)
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.ui.api_request import ApiError, read_job, route_fields
from qwen_image_fusion.ui.api_schema import body_model
from qwen_image_fusion.ui.app import build_app
from qwen_image_fusion.ui.cli import REQUIRED_FLAGS, build_parser, error_text
from qwen_image_fusion.ui.generation import DEMO_FIELDS, FieldError, request_of
from qwen_image_fusion.ui.limits import Limits

CALL_CONTROLS = {"self", "on_step", "progress", "output_type"}  # generate()'s arguments that are not options
NOT_REQUEST_FLAGS = {"help", "out", "lora", "lora_mode", "model", "device", "dtype", "variant", "gpu_memory"}
SPEC = inspect_checkpoint(None)  # the embedded default's configs, read without torch
CONTROL_SPEC = replace(SPEC, takes_control=True)  # as a ControlNet checkpoint: its control values checked
IMAGE = Image.new("RGB", (64, 64))


def signature_defaults(function) -> dict[str, object]:
    return {name: p.default for name, p in inspect.signature(function).parameters.items()}


@pytest.mark.parametrize(
    "function", [Pipeline.generate, resolve_request], ids=["generate", "resolve_request"]
)
def test_the_signatures_are_the_declarations(function) -> None:
    """Names and defaults: a declared value, None where the pipeline (or the checkpoint) decides, and no
    default for the prompt."""
    parameters = signature_defaults(function)
    options = {name: value for name, value in parameters.items() if name in OPTION}
    assert set(options) == set(OPTION)
    for option in OPTIONS:
        expected = inspect.Parameter.empty if option.default is REQUIRED else option.given_default
        assert options[option.name] == expected, option.name
    others = set(parameters) - set(OPTION)
    assert others <= CALL_CONTROLS | {"spec", "suggest_size", "loras"}, others


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


@pytest.mark.parametrize("command", CLI_COMMANDS)
def test_the_cli_flags_are_the_declarations(command: str) -> None:
    """Flag, type, choices, default, help with bounds: as declared; and no request flag beside them."""
    actions = {a.dest: a for a in subparsers(build_parser())[command]._actions}
    declared = list(cli_options(command))
    for option, flag in declared:
        action = actions[option.name]
        positional = not flag.startswith("-")
        assert (action.metavar == flag) if positional else (flag in action.option_strings), option.name
        help_text = action.help.replace("%%", "%")
        assert option.help in help_text and (not option.bounds or f"({option.bounds})" in help_text)
        if option.default is FROM_MODEL:
            assert "(default: the model's" in help_text
        if not positional:
            assert action.default == ("" if option.default is REQUIRED else option.given_default), option.name
        kinds = {WHOLE: int, NUMBER: float, NUMBERS: float}
        if option.kind in kinds:
            assert action.type is kinds[option.kind]
        if option.kind == CHOICE:
            assert tuple(action.choices) == option.choices
        if option.kind == FLAG:
            assert isinstance(action, argparse._StoreTrueAction)
        if option.kind == IMAGES and not positional:
            assert isinstance(action, argparse._AppendAction)
        assert action.required == (positional or (command, option.name) in REQUIRED_FLAGS)
    others = NOT_REQUEST_FLAGS | ({"gpus"} if command != "layers" else set())  # layers runs on one GPU
    assert set(actions) - {option.name for option, _ in declared} == others


def test_an_unknown_flag_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "a fox", "--num-inference-steps", "4"])
    assert "unrecognized arguments: --num-inference-steps" in capsys.readouterr().err


@pytest.mark.parametrize("route", [GENERATIONS, EDITS])
def test_the_http_bodies_are_the_declarations(route: str) -> None:
    """Each declared field's description, default and bounds (a server's bounds) in the body model that
    /openapi.json publishes; its fields are exactly those the parser takes."""
    schema = body_model(route).model_json_schema()
    properties = schema["properties"]
    assert set(properties) | {"image[]"} == set(route_fields(route)) | {"image[]"}
    for option, field in http_options(route):
        if field == "size":  # width and height, each with its bounds
            assert f"{option.help} ({option.bounds})" in properties["size"]["description"]
            continue
        if sum(f == field for _, f in http_options(route)) > 1:  # an edit's image: input or start image
            assert f"{option.name}: {option.help}" in properties[field]["description"]
            continue
        prop = properties[field]
        assert prop["description"] == option.help
        if option.default is REQUIRED:
            assert field in schema["required"]
            continue
        assert prop["default"] == option.given_default, field
        low, high = option.served_bounds
        bounds = prop["anyOf"][0]
        assert bounds.get("exclusiveMinimum" if option.low_open else "minimum") == low, field
        assert bounds.get("maximum") == high, field


@pytest.mark.parametrize("route", [GENERATIONS, EDITS])
def test_an_unknown_http_field_is_refused_by_name(route: str) -> None:
    images = [IMAGE] if route == EDITS else None
    with pytest.raises(ApiError) as caught:
        read_job({"prompt": "x", "steps": 4}, FakePipe(), Limits.for_device("cpu"), "contract", images)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "steps", "unknown_parameter")


def test_the_demo_controls_are_the_declarations() -> None:
    """The settings sliders span the declared ranges (a server's bound for the image count, the declared
    demo range where the bounds are open) and show the declared help."""
    demo = build_app(FakePipe())
    sliders = {c.label: c for c in demo.blocks.values() if isinstance(c, gr.Slider)}
    for label, name in (("Steps", "num_inference_steps"), ("True CFG scale", "true_cfg_scale"),
                        ("Images", "num_images_per_prompt")):  # fmt: skip
        option = OPTION[name]
        low, high = option.demo_range or option.served_bounds
        assert (sliders[label].minimum, sliders[label].maximum) == (low, high), label
        assert sliders[label].info == option.help
    assert set(DEMO_FIELDS.values()) >= {"prompt", "num_images", "num_inference_steps", "seed", "strength"}
    assert all(OPTION[name].demo == field for name, field in DEMO_FIELDS.items())


def test_the_eval_worker_reads_the_declared_keys_and_refuses_others(tmp_path) -> None:
    path = tmp_path / "start.png"
    IMAGE.save(path)
    prompt, values = request_values({"id": "p0", "png": "x.png", "prompt": "a fox", "steps": 3,
                                     "init_image": str(path), "control": []})  # fmt: skip
    assert prompt == "a fox" and values["num_inference_steps"] == 3 and values["control_image"] is None
    assert values["init_image"].size == (64, 64) and set(values) | {"prompt"} == {
        o.name for o in OPTIONS if o.eval and o.name not in PER_WORKER
    }
    with pytest.raises(InputError, match="unknown request key 'num_inference_steps'") as caught:
        request_values({"id": "p0", "png": "x.png", "prompt": "a fox", "num_inference_steps": 3})
    assert caught.value.field == "num_inference_steps" and set(PROTOCOL_KEYS) == {"id", "png"}
    actions = {a.dest: a for a in worker_parser()._actions}
    for name in PER_WORKER:
        assert OPTION[name].cli[GENERATE] in actions[name].option_strings
        assert actions[name].default == OPTION[name].given_default


# A bad value of every option, and the option its error must name. Built against the embedded default
# (text to image, no ControlNet, no captions): a value its model cannot take is refused too.
NAN = math.nan
BAD = {
    "prompt": {"prompt": "  "},
    "negative_prompt": {"negative_prompt": 5},
    "width": {"width": 40},
    "height": {"height": 4096},
    "num_inference_steps": {"num_inference_steps": 1},
    "true_cfg_scale": {"true_cfg_scale": NAN},
    "seed": {"seed": -1},
    "num_images_per_prompt": {"num_images_per_prompt": 17},
    "max_sequence_length": {"max_sequence_length": 0},
    "preset": {"preset": "turbo"},
    "lora_scales": {"lora_scales": {"style": 1.0}},
    "image": {"image": [IMAGE]},
    "cache": {"cache": "fastest"},
    "init_image": {"init_image": "photo.png"},
    "strength": {"init_image": IMAGE, "strength": 1.5},
    "mask_image": {"mask_image": IMAGE},
    "padding_mask_crop": {"init_image": IMAGE, "mask_image": IMAGE, "padding_mask_crop": -2},
    "control_image": {"control_image": [IMAGE]},
    "controlnet_conditioning_scale": {"controlnet_conditioning_scale": 0.5},
    "control_guidance_start": {
        "control_image": [IMAGE],
        "control_guidance_start": 0.5,
        "control_guidance_end": 0,
    },
    "control_guidance_end": {"control_image": [IMAGE], "control_guidance_end": 2.0},
    "control_mode": {"control_mode": "canny"},
    "control_mask": {"control_mask": IMAGE},
    "layers": {"layers": 2},
    "resolution": {"resolution": 640},
    "use_en_prompt": {"use_en_prompt": True},
    "fast_decode": {"fast_decode": "yes"},
}


def test_every_option_has_a_bad_value_case() -> None:
    assert set(BAD) == set(OPTION)


@pytest.mark.parametrize("name", list(BAD))
def test_an_error_names_its_option_and_each_front_end_its_own_input(name: str) -> None:
    values = dict(BAD[name])
    prompt = values.pop("prompt", "a red fox")
    spec = CONTROL_SPEC if name.startswith("control_guidance") else SPEC
    with pytest.raises(InputError) as caught:
        resolve_request(spec, prompt, loras={}, **values)
    assert caught.value.field == name, str(caught.value)
    option = OPTION[name]
    flag = next((option.cli[c] for c in CLI_COMMANDS if c in option.cli), None)
    command = next((c for c in CLI_COMMANDS if c in option.cli), GENERATE)
    assert error_text(caught.value, command) == (f"{flag}: {caught.value}" if flag else str(caught.value))
    for route in (GENERATIONS, EDITS):
        fields = {option.name: field for option, field in http_options(route)}
        pipe = FakePipe()
        pipe.request = lambda p, **v: resolve_request(spec, p, loras={}, **v)
        with pytest.raises(FieldError) as front:
            request_of(pipe, fields, prompt, **values)
        assert front.value.field == fields.get(name, "prompt")


def test_the_server_publishes_the_bodies_and_says_what_ran() -> None:
    """/openapi.json carries each route's body model (behind the API keys, as the other routes); a response's
    `run` is the RunInfo of what ran."""
    from fastapi.testclient import TestClient

    from qwen_image_fusion.ui.access import ApiKeys
    from qwen_image_fusion.ui.runner import Runner
    from qwen_image_fusion.ui.server import build_server

    pipe = FakePipe()
    runner = Runner(pipe, Limits.for_device("cpu"))
    key = "k" * 16
    try:
        client = TestClient(build_server(pipe, runner, ApiKeys([key])))
        assert client.get("/openapi.json").status_code == 401
        document = client.get("/openapi.json", headers={"Authorization": f"Bearer {key}"}).json()
        for path, route, media in (("/v1/images/generations", GENERATIONS, "application/json"),
                                   ("/v1/images/edits", EDITS, "multipart/form-data")):  # fmt: skip
            published = document["paths"][path]["post"]["requestBody"]["content"][media]["schema"]
            declared = body_model(route).model_json_schema()["properties"]
            assert {name: prop.get("description") for name, prop in published["properties"].items()} == {
                name: prop.get("description") for name, prop in declared.items()
            }
        body = {"prompt": "a fox", "size": "64x32", "num_inference_steps": 3, "seed": 1}
        answer = client.post("/v1/images/generations", json=body, headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        run, info = answer.json()["run"], pipe.last_run
        assert (run["variant"], run["num_inference_steps"], run["timings"]) == (info.variant, 3, info.timings)
        assert run["cache"] is None and run["decode"] is None  # the fake ran neither
    finally:
        runner.close()


def test_the_server_imports_no_gradio_module_without_the_demo() -> None:
    """`qwen-image serve` without --ui: the server, its routes, parsing and schema, and LoRA mounting import
    nothing of Gradio (the demo's modules are imported only where it is mounted)."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import qwen_image_fusion.ui.server, qwen_image_fusion.ui.api_schema\n"
        "from qwen_image_fusion.pipelines.presets import load_lora_files\n"
        "demo = ('gradio', 'qwen_image_fusion.ui.app', 'qwen_image_fusion.ui.lora_controls')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gradio' or m in demo))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
