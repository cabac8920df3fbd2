"""A full-size Qwen-Image checkpoint made of configs and safetensors headers only (no weight data), so the
torch-free memory planner and `info --gpu-memory` can be tested at the real sizes on any machine."""

import json
import struct
from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage
from transformers import Qwen2_5_VLForConditionalGeneration

from models.checkpoint import read_json
from models.modelopt import QuantConfig
from models.qwen_image.components import SCHEDULER_CONFIG
from models.qwen_image.config import QwenImageConfig
from models.qwen_image.model import QUANTIZATION
from models.qwen_image.text_encoder import tiny_text_encoder_config
from models.qwen_image.transformer import QwenImageTransformer

TEXT_7B = {  # Qwen2.5-VL-7B's language model (bench/make_random_checkpoint.py builds the same)
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_window_layers": 28,
}
DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def write_header(path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """A safetensors file holding only its header (offsets as if the data followed)."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def shapes(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (dtype, tuple(t.shape)) for name, t in module.state_dict().items()}


def header_only_checkpoint(directory: Path, fp8: bool = True) -> Path:
    """The public Qwen-Image's sizes: 60-layer DiT (FP8 with the default BF16 fallback list when `fp8`),
    a Qwen2.5-VL-7B-sized text encoder (tiny vision tower, as bench/make_random_checkpoint.py) and the VAE."""
    config = tiny_text_encoder_config(hidden_size=3584, num_layers=28)
    for key, value in TEXT_7B.items():
        setattr(config.text_config, key, value)
    config.text_config.rope_parameters["mrope_section"] = [16, 24, 24]
    with torch.device("meta"):
        text = Qwen2_5_VLForConditionalGeneration(config)
        transformer = QwenImageTransformer(QwenImageConfig())
        vae = AutoencoderKLQwenImage()
    text.config.save_pretrained(directory / "text_encoder")
    write_header(directory / "text_encoder" / "model.safetensors", shapes(text, torch.bfloat16))
    vae.save_config(directory / "vae")
    write_header(directory / "vae" / "diffusion_pytorch_model.safetensors", shapes(vae, torch.bfloat16))
    tensors = shapes(transformer, torch.bfloat16)
    raw = transformer.config.to_dict()
    if fp8:
        kept = QuantConfig("FP8", QUANTIZATION.bf16_fallback)
        for name, module in transformer.named_modules():
            if isinstance(module, torch.nn.Linear) and not kept.ignores(name):
                tensors[f"{name}.weight"] = (torch.float8_e4m3fn, tuple(module.weight.shape))
                tensors[f"{name}.weight_scale"] = (torch.float32, ())
                tensors[f"{name}.input_scale"] = (torch.float32, ())
        raw["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "FP8",
            "ignore": list(kept.ignore),
        }
    (directory / "transformer").mkdir(parents=True, exist_ok=True)
    (directory / "transformer" / "config.json").write_text(json.dumps(raw))
    write_header(directory / "transformer" / "diffusion_pytorch_model.safetensors", tensors)
    (directory / "scheduler").mkdir(parents=True, exist_ok=True)
    (directory / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG))
    (directory / "tokenizer").mkdir(parents=True, exist_ok=True)
    index = read_json(Path(__file__).parents[1] / "models" / "default_model" / "model_index.json")
    index.pop("_generation_defaults")
    (directory / "model_index.json").write_text(json.dumps(index))
    return directory
