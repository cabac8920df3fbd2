"""Write a full-size Qwen-Image checkpoint with random weights (FP8 transformer by default) for GPU runs.

Real architecture and sizes: the 60-layer DiT, a Qwen2.5-VL-7B-sized language model (tiny vision
tower: prompts never use it), the full VAE and the real tokenizer. The DiT is calibrated through the
real `quantize` path (true CFG, a few steps) and written as a ModelOpt FP8 checkpoint.

    python bench/make_random_checkpoint.py --out /tmp/qwen-image-random-fp8 [--bf16] [--layers 60]
    python bench/make_random_checkpoint.py --out /tmp/qwen-image-random-fp8mod --fp8-modulation
"""

import argparse
import time
from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage
from transformers import Qwen2_5_VLForConditionalGeneration

from models.family import GenerationDefaults
from models.qwen_image.components import Components, default_scheduler, save_components
from models.qwen_image.config import QwenImageConfig
from models.qwen_image.family import FAMILY
from models.qwen_image.model import QwenImageModel
from models.qwen_image.text_encoder import qwen25_vl_7b_config
from models.qwen_image.tokenizer import build_qwen2_tokenizer
from models.qwen_image.transformer import QwenImageTransformer
from pipelines.pipeline import Pipeline
from pipelines.quantize import quantize_pipeline


def full_size_components(layers: int, device: torch.device) -> Components:
    """Random-weight components at the public checkpoint's sizes, built on `device` in bf16."""
    torch.manual_seed(0)
    config = qwen25_vl_7b_config()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval().requires_grad_(False)
        transformer = QwenImageTransformer(QwenImageConfig(num_layers=layers)).eval().requires_grad_(False)
        vae = AutoencoderKLQwenImage().eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    transformer.post_load_weights()
    return Components(build_qwen2_tokenizer(), text_encoder, transformer, vae, default_scheduler())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--bf16", action="store_true", help="write the BF16 checkpoint instead of FP8")
    parser.add_argument(
        "--fp8-modulation",
        action="store_true",
        help="the modulation FP8 weight-only (quantize --fp8-modulation)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.time()
    components = full_size_components(args.layers, device)
    print(f"built full-size random components in {time.time() - start:.0f} s", flush=True)
    if args.bf16:
        save_components(components, args.out)
    else:
        model = QwenImageModel(components, device, torch.bfloat16)
        pipe = Pipeline.from_model(model, FAMILY.spec_for(model, "random-full-size", GenerationDefaults()))
        quantize_pipeline(
            pipe,
            args.out,
            prompts=["a red fox in the snow"],
            steps=4,
            size=512,
            fp8_modulation=args.fp8_modulation,
        )
    print(f"wrote {args.out} in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
