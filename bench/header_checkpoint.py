"""A full-size Qwen-Image (or Edit-2511) checkpoint made of configs and safetensors headers only (no weight
data, 1 MB): the GPU-memory planner reads nothing else, so `qwen-image info --gpu-memory SIZE` shows the
plans of the real sizes on any machine (loading it then fails: there are no weights).

    python bench/header_checkpoint.py --out /tmp/qwen-image-headers [--fp8-modulation] [--bf16] [--edit]
    qwen-image info --model /tmp/qwen-image-headers --gpu-memory 24GiB
"""

import argparse
import json
import struct
from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

from models.embedded import DEFAULT_MODEL_DIR
from models.fp8_weight_only import WEIGHT_ONLY_KEY
from models.modelopt import QuantConfig
from models.qwen_image.components import SCHEDULER_CONFIG
from models.qwen_image.config import QwenImageConfig
from models.qwen_image.model import QUANTIZATION
from models.qwen_image.text_encoder import qwen25_vl_7b_config
from models.qwen_image.transformer import QwenImageTransformer

DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
Shapes = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def write_header(path: Path, tensors: Shapes) -> None:
    """A safetensors file holding only its header (offsets as if the data followed)."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def shapes(module: torch.nn.Module, dtype: torch.dtype) -> Shapes:
    return {name: (dtype, tuple(t.shape)) for name, t in module.state_dict().items()}


def fp8_transformer(transformer: torch.nn.Module, fp8_modulation: bool) -> tuple[Shapes, dict]:
    """The tensors and quantization config `qwen-image quantize` writes (default BF16 fallback list; the
    modulation FP8 weight-only with `fp8_modulation`)."""
    weight_only = QUANTIZATION.weight_only if fp8_modulation else ()
    kept = QuantConfig("FP8", tuple(g for g in QUANTIZATION.bf16_fallback if g not in weight_only))
    moved = QuantConfig("FP8", weight_only=weight_only)
    tensors = shapes(transformer, torch.bfloat16)
    for name, module in transformer.named_modules():
        if not isinstance(module, torch.nn.Linear) or kept.ignores(name):
            continue
        tensors[f"{name}.weight"] = (torch.float8_e4m3fn, tuple(module.weight.shape))
        if moved.weight_only_layer(name):
            tensors[f"{name}.weight_scale"] = (torch.float32, (module.out_features,))
        else:
            tensors[f"{name}.weight_scale"] = (torch.float32, ())
            tensors[f"{name}.input_scale"] = (torch.float32, ())
    config = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": list(kept.ignore)}
    return tensors, config | ({WEIGHT_ONLY_KEY: list(weight_only)} if weight_only else {})


def header_only_checkpoint(
    directory: Path, fp8: bool = True, fp8_modulation: bool = False, edit: bool = False
) -> Path:
    """The public Qwen-Image's sizes: the 60-layer DiT (FP8 as `quantize` writes it when `fp8`), a
    Qwen2.5-VL-7B-sized text encoder and the VAE, as headers; with `edit`, Edit-2511's (zero_cond_t, the
    real vision tower, a processor)."""
    with torch.device("meta"):
        text = Qwen2_5_VLForConditionalGeneration(qwen25_vl_7b_config(vision=edit))
        transformer = QwenImageTransformer(QwenImageConfig(zero_cond_t=edit))
        vae = AutoencoderKLQwenImage()
    text.config.save_pretrained(directory / "text_encoder")
    write_header(directory / "text_encoder" / "model.safetensors", shapes(text, torch.bfloat16))
    vae.save_config(directory / "vae")
    write_header(directory / "vae" / "diffusion_pytorch_model.safetensors", shapes(vae, torch.bfloat16))
    raw = transformer.config.to_dict()
    tensors = shapes(transformer, torch.bfloat16)
    if fp8:
        tensors, raw["quantization_config"] = fp8_transformer(transformer, fp8_modulation)
    (directory / "transformer").mkdir(parents=True, exist_ok=True)
    (directory / "transformer" / "config.json").write_text(json.dumps(raw))
    write_header(directory / "transformer" / "diffusion_pytorch_model.safetensors", tensors)
    (directory / "scheduler").mkdir(parents=True, exist_ok=True)
    (directory / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG))
    (directory / "tokenizer").mkdir(parents=True, exist_ok=True)
    index = json.loads((DEFAULT_MODEL_DIR / "model_index.json").read_text())
    index.pop("_generation_defaults")
    if edit:
        index |= {
            "_class_name": "QwenImageEditPlusPipeline",
            "processor": ["transformers", "Qwen2VLProcessor"],
        }
        Qwen2VLImageProcessorPil().save_pretrained(directory / "processor")
    (directory / "model_index.json").write_text(json.dumps(index))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bf16", action="store_true", help="a BF16 transformer instead of FP8")
    parser.add_argument("--fp8-modulation", action="store_true", help="the modulation FP8 weight-only")
    parser.add_argument("--edit", action="store_true", help="Qwen-Image-Edit-2511's sizes")
    args = parser.parse_args()
    print(f"wrote {header_only_checkpoint(args.out, not args.bf16, args.fp8_modulation, args.edit)}")


if __name__ == "__main__":
    main()
