"""A full-size Qwen-Image (or Edit-2511, or Qwen-Image 2.1) checkpoint made of configs and safetensors
headers only (no weight data, 1 MB): the GPU-memory planner reads nothing else, so `qwen-image info
--gpu-memory SIZE` shows the plans of the real sizes on any machine (loading it then fails: there are no
weights).

    python bench/header_checkpoint.py --out /tmp/qwen-image-headers [--fp8-modulation] [--bf16] [--edit]
    python bench/header_checkpoint.py --out /tmp/qwen-image-headers-nvfp4 --nvfp4 [--edit]
    python bench/header_checkpoint.py --out /tmp/qwen-image-21-headers --qi21 [--nvfp4]
    qwen-image info --model /tmp/qwen-image-headers --gpu-memory 24GiB
"""

import argparse
import json
import struct
from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLQwenImage21
from transformers import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen3VLForConditionalGeneration,
)

from qwen_image_fusion.kernels.nvfp4 import NVFP4_BLOCK
from qwen_image_fusion.models.checkpoint import WeightFormat
from qwen_image_fusion.models.embedded import DEFAULT_MODEL_DIR
from qwen_image_fusion.models.family import QuantRecipe
from qwen_image_fusion.models.fp8_weight_only import WEIGHT_ONLY_KEY
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.qwen_image.components import SCHEDULER_CONFIG
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.model import QUANTIZATION
from qwen_image_fusion.models.qwen_image.text_encoder import qwen25_vl_7b_config
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer
from qwen_image_fusion.models.qwen_image21 import synthetic
from qwen_image_fusion.models.qwen_image21.checkpoint import PIPELINE_CLASS
from qwen_image_fusion.models.qwen_image21.components import save_processor
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION as QUANTIZATION21
from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer
from qwen_image_fusion.pipelines.quantize import nvfp4_fallback, quantization_configs

DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}
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


def fp8_transformer(
    transformer: torch.nn.Module, fp8_modulation: bool, recipe: QuantRecipe = QUANTIZATION
) -> tuple[Shapes, dict]:
    """The tensors and quantization config `qwen-image quantize` writes with the family's `recipe` (its
    default BF16 fallback list; the modulation FP8 weight-only with `fp8_modulation`)."""
    weight_only = recipe.weight_only if fp8_modulation else ()
    kept = QuantConfig("FP8", tuple(g for g in recipe.bf16_fallback if g not in weight_only))
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


def nvfp4_transformer(
    transformer: torch.nn.Module, recipe: QuantRecipe = QUANTIZATION
) -> tuple[Shapes, dict]:
    """The tensors and quantization config `qwen-image quantize --format nvfp4` writes with its default BF16
    rules (every linear outside the blocks, the first two and last two blocks)."""
    ignore = nvfp4_fallback(recipe, transformer)
    kept = QuantConfig("NVFP4", ignore)
    tensors = shapes(transformer, torch.bfloat16)
    for name, module in transformer.named_modules():
        if not isinstance(module, torch.nn.Linear) or kept.ignores(name):
            continue
        out, k = module.weight.shape
        tensors[f"{name}.weight"] = (torch.uint8, (out, k // 2))
        tensors[f"{name}.weight_scale"] = (torch.float8_e4m3fn, (out, k // NVFP4_BLOCK))
        tensors[f"{name}.weight_scale_2"] = (torch.float32, ())
        tensors[f"{name}.input_scale"] = (torch.float32, ())
    return tensors, quantization_configs(WeightFormat.NVFP4, ignore)[0]


def write_components(
    directory: Path, text: torch.nn.Module, vae: torch.nn.Module, transformer: dict, tensors: Shapes
) -> None:
    """The text encoder and VAE (BF16), the transformer (`transformer` its config.json content, `tensors`
    its header) and the scheduler, as configs and headers."""
    text.config.save_pretrained(directory / "text_encoder")
    write_header(directory / "text_encoder" / "model.safetensors", shapes(text, torch.bfloat16))
    vae.save_config(directory / "vae")
    write_header(directory / "vae" / "diffusion_pytorch_model.safetensors", shapes(vae, torch.bfloat16))
    (directory / "transformer").mkdir(parents=True, exist_ok=True)
    (directory / "transformer" / "config.json").write_text(json.dumps(transformer))
    write_header(directory / "transformer" / "diffusion_pytorch_model.safetensors", tensors)
    (directory / "scheduler").mkdir(parents=True, exist_ok=True)
    (directory / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG))


def header_only_checkpoint(
    directory: Path, fp8: bool = True, fp8_modulation: bool = False, edit: bool = False, nvfp4: bool = False
) -> Path:
    """The public Qwen-Image's sizes: the 60-layer DiT (FP8 as `quantize` writes it when `fp8`, NVFP4 when
    `nvfp4`), a Qwen2.5-VL-7B-sized text encoder and the VAE, as headers; with `edit`, Edit-2511's
    (zero_cond_t, the real vision tower, a processor)."""
    with torch.device("meta"):
        text = Qwen2_5_VLForConditionalGeneration(qwen25_vl_7b_config(vision=edit))
        transformer = QwenImageTransformer(QwenImageConfig(zero_cond_t=edit))
        vae = AutoencoderKLQwenImage()
    raw = transformer.config.to_dict()
    tensors = shapes(transformer, torch.bfloat16)
    if nvfp4:
        tensors, raw["quantization_config"] = nvfp4_transformer(transformer)
    elif fp8:
        tensors, raw["quantization_config"] = fp8_transformer(transformer, fp8_modulation)
    write_components(directory, text, vae, raw, tensors)
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


def qi21_header_checkpoint(directory: Path, nvfp4: bool = False) -> Path:
    """Qwen-Image 2.1's released sizes as headers: the 32-layer 7B DiT in FP8 (the family's recipe) or NVFP4,
    the Qwen3-VL-8B text encoder with its vision tower, the 16x VAE, the processor."""
    with torch.device("meta"):
        config = synthetic.text_encoder_config(synthetic.QWEN3_VL_8B_TEXT, synthetic.QWEN3_VL_8B_VISION)
        text = Qwen3VLForConditionalGeneration(config)
        transformer = QwenImage21Transformer(QwenImage21Config())
        vae = AutoencoderKLQwenImage21()
    if nvfp4:
        tensors, quantization = nvfp4_transformer(transformer, QUANTIZATION21)
    else:
        tensors, quantization = fp8_transformer(transformer, False, QUANTIZATION21)
    raw = transformer.config.to_dict() | {"quantization_config": quantization}
    write_components(directory, text, vae, raw, tensors)
    save_processor(synthetic.processor(), directory / "processor")
    index = {"_class_name": PIPELINE_CLASS, "_diffusers_version": "0.42.1"}
    (directory / "model_index.json").write_text(json.dumps(index))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bf16", action="store_true", help="a BF16 transformer instead of FP8")
    parser.add_argument("--fp8-modulation", action="store_true", help="the modulation FP8 weight-only")
    parser.add_argument("--edit", action="store_true", help="Qwen-Image-Edit-2511's sizes")
    parser.add_argument("--qi21", action="store_true", help="Qwen-Image 2.1's sizes (FP8)")
    parser.add_argument(
        "--nvfp4", action="store_true", help="an NVFP4 transformer (quantize's default rules)"
    )
    args = parser.parse_args()
    if args.qi21:
        print(f"wrote {qi21_header_checkpoint(args.out, args.nvfp4)}")
    else:
        written = header_only_checkpoint(args.out, not args.bf16, args.fp8_modulation, args.edit, args.nvfp4)
        print(f"wrote {written}")


if __name__ == "__main__":
    main()
