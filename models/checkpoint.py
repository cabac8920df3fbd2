"""A checkpoint directory read without torch: its JSON files, and which model family serves it.

The CLI, the UI and the pipeline call `inspect_checkpoint` first, so every argument that the configs can
decide (size multiple, attention heads, FP8 or not, defaults, images accepted) is checked before any
weight is read or any heavy library is imported.
"""

import json
from enum import StrEnum
from pathlib import Path
from typing import Any

from qwen_image_fusion.models.errors import CheckpointError


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file, refusing a missing or malformed one with a message naming it."""
    if not path.is_file():
        raise CheckpointError(f"missing {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def check_model_dir(model_dir: Path) -> None:
    """CheckpointError unless `model_dir` is an existing directory."""
    if not model_dir.exists():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise CheckpointError(f"model path {model_dir} is a file, not a directory")


def read_model_index(directory: Path) -> dict[str, Any]:
    """The model_index.json of a checkpoint directory (CheckpointError when there is none)."""
    check_model_dir(directory)
    return read_json(directory / "model_index.json")


def check_layout(directory: Path, components: tuple[str, ...]) -> None:
    """Refuse a directory lacking any of the folders of `components`, naming what lacks."""
    missing = [name for name in components if not (directory / name).is_dir()]
    if missing:
        raise CheckpointError(f"{directory} is incomplete: missing {', '.join(missing)}/")


def read_hf_quant_config(directory: Path) -> dict[str, Any] | None:
    """The nested ModelOpt `hf_quant_config.json` of a transformer directory (or its parent), if any."""
    for path in (directory / "hf_quant_config.json", directory.parent / "hf_quant_config.json"):
        if path.is_file():
            return read_json(path)
    return None


# processor key -> the vision tower's config key
VISION_KEYS = {
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "merge_size": "spatial_merge_size",
}


def check_vision_processor(processor: Path, text_encoder: Path) -> None:
    """Refuse a vision-language checkpoint whose text encoder has no vision tower, or whose `processor/`
    patches images otherwise than that tower (patch size, temporal patch size, merge size), naming both
    values: the image slots the processor writes must be the ones the tower fills."""
    found = read_json(processor / "preprocessor_config.json")
    vision = read_json(text_encoder / "config.json").get("vision_config")
    if not isinstance(vision, dict):
        raise CheckpointError(f"{text_encoder / 'config.json'} has no vision_config: it cannot see images")
    for key, theirs in VISION_KEYS.items():
        if found.get(key) is not None and vision.get(theirs) is not None and found[key] != vision[theirs]:
            raise CheckpointError(
                f"{processor}: {key} {found[key]} differs from the text encoder's vision {theirs} "
                f"{vision[theirs]}"
            )


class WeightFormat(StrEnum):
    """How a transformer's linears are stored: BF16, or a ModelOpt export (DESIGN §3 FP8, §19 NVFP4)."""

    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


QUANT_FORMATS = (WeightFormat.FP8.value, WeightFormat.NVFP4.value)  # what `qwen-image quantize` writes
# ModelOpt's per-layer scales (FP8: weight_scale, input_scale; NVFP4 adds weight_scale_2): loaded as stored
MODELOPT_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")
MODELOPT_ALGOS = {"FP8": WeightFormat.FP8, "NVFP4": WeightFormat.NVFP4}  # ModelOpt's quant_algo names


def modelopt_format(algo: object) -> WeightFormat:
    """The weight format of a ModelOpt `quant_algo`; CheckpointError naming the supported ones otherwise."""
    found = MODELOPT_ALGOS.get(str(algo).upper())
    if found is None:
        raise CheckpointError(
            f"unsupported ModelOpt quant_algo {algo!r}: only FP8 (per-tensor static) and NVFP4 are supported"
        )
    return found


def modelopt_section(config: dict[str, Any], hf_quant_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ModelOpt quantization section of a transformer: config.json's flat `quantization_config` (its
    `quant_method` must be modelopt), else hf_quant_config.json's nested `quantization`; None for neither."""
    flat = config.get("quantization_config")
    if flat is not None:
        method = str(flat.get("quant_method", "")).lower() if isinstance(flat, dict) else None
        if method != "modelopt":
            raise CheckpointError(f"unsupported quantization method {method!r}: only ModelOpt is supported")
        return flat
    if hf_quant_config is None:
        return None
    nested = hf_quant_config.get("quantization")
    if not isinstance(nested, dict):
        raise CheckpointError("hf_quant_config.json has no quantization section")
    return nested


def transformer_weights(directory: Path) -> WeightFormat:
    """The weight format a transformer directory declares (its ModelOpt `quant_algo`), BF16 without one."""
    section = modelopt_section(read_json(directory / "config.json"), read_hf_quant_config(directory))
    return WeightFormat.BF16 if section is None else modelopt_format(section.get("quant_algo"))


def weight_files(directory: Path) -> list[Path]:
    """Safetensors files of a component directory: the shards of its index, or its single file."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = read_json(indexes[0]).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{indexes[0]} has no weight_map")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{directory}: shards listed in {indexes[0].name} are missing: {missing[:3]}"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {directory}")
    return files
