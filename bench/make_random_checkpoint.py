"""Write a full-size Qwen-Image checkpoint with random weights (FP8 transformer by default) for GPU runs.

Real architecture and sizes: the 60-layer DiT, a Qwen2.5-VL-7B-sized language model (tiny vision
tower: prompts never use it), the full VAE and the real tokenizer. The DiT is calibrated through the
real `quantize` path (true CFG, a few steps) and written as a ModelOpt FP8 checkpoint.

`--edit` writes an Edit-2511 checkpoint instead (`QwenImageEditPlusPipeline`, `zero_cond_t`): the same DiT,
Qwen2.5-VL-7B's full-size vision tower (it sees the input images), the Qwen2-VL processor, calibrated on two
of the built-in image + instruction pairs (`--edit --edit-single`: the one-image Edit,
`QwenImageEditPipeline`, which inpaints, calibrated on two one-image pairs). `--qi21` writes a Qwen-Image 2.1
one (`QwenImage21Pipeline`: the 32-layer 7B DiT unless `--layers`, Qwen3-VL-8B with its vision tower, the 16x
VAE, the Qwen3-VL processor), calibrated on one prompt with the family's recipe. `--controlnet N` adds an
N-block ControlNet (`QwenImageControlNetPipeline`; InstantX's Union has 5; with `--inpaint` an inpainting
one), calibrated on a prompt and an edge-map request. `--layered` writes a Qwen-Image-Layered one
(`QwenImageLayeredPipeline`: the DiT with the layer-3D RoPE and task embedding, the RGBA VAE, the processor),
calibrated on two built-in image + prompt pairs decomposed into four layers.

    python bench/make_random_checkpoint.py --out /tmp/qwen-image-random-fp8 [--bf16] [--layers 60] [--edit]
    python bench/make_random_checkpoint.py --out /tmp/qwen-image-21-random-fp8 --qi21
    python bench/make_random_checkpoint.py --out /tmp/qwen-image-random-fp8mod --fp8-modulation
    python bench/make_random_checkpoint.py --out /tmp/qwen-image-controlnet-random-fp8 --controlnet 5
    python bench/make_random_checkpoint.py --out /tmp/qwen-image-layered-random-fp8 --layered
"""

import argparse
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLQwenImage21
from PIL import Image
from transformers import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen3VLForConditionalGeneration,
)

from qwen_image_fusion.models.family import GenerationDefaults
from qwen_image_fusion.models.qwen_image.components import Components, default_scheduler
from qwen_image_fusion.models.qwen_image.config import ControlNetConfig, QwenImageConfig
from qwen_image_fusion.models.qwen_image.controlnet import QwenImageControlNet
from qwen_image_fusion.models.qwen_image.controlnet_family import FAMILY as CONTROLNET_FAMILY
from qwen_image_fusion.models.qwen_image.family import FAMILY
from qwen_image_fusion.models.qwen_image.model import QwenImageModel
from qwen_image_fusion.models.qwen_image.text_encoder import qwen25_vl_7b_config
from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer
from qwen_image_fusion.models.qwen_image21 import synthetic
from qwen_image_fusion.models.qwen_image21.components import Components21
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image21.family import FAMILY as FAMILY21
from qwen_image_fusion.models.qwen_image21.model import QwenImage21Model
from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer
from qwen_image_fusion.models.qwen_image_edit.components import EditComponents
from qwen_image_fusion.models.qwen_image_edit.conditioning import load_processor
from qwen_image_fusion.models.qwen_image_edit.config import EDIT_KINDS
from qwen_image_fusion.models.qwen_image_edit.family import FAMILY as EDIT_FAMILY
from qwen_image_fusion.models.qwen_image_edit.model import QwenImageEditModel
from qwen_image_fusion.models.qwen_image_layered.components import LayeredComponents
from qwen_image_fusion.models.qwen_image_layered.family import FAMILY as LAYERED_FAMILY
from qwen_image_fusion.models.qwen_image_layered.model import QwenImageLayeredModel
from qwen_image_fusion.pipelines.pipeline import Pipeline
from qwen_image_fusion.pipelines.quantize import quantize_pipeline
from qwen_image_fusion.pipelines.requests import Request, edit_requests_for


def full_size_components(
    layers: int,
    device: torch.device,
    edit: bool = False,
    controlnet_layers: int = 0,
    controlnet_inpaints: bool = False,
    layered: bool = False,
    zero_cond_t: bool | None = None,
) -> Components:
    """Random-weight components at the public checkpoint's sizes, built on `device` in bf16 (`edit`: an
    Edit-2511 DiT with `zero_cond_t` and the full vision tower; `controlnet_layers`: a ControlNet of that
    many blocks, `controlnet_inpaints`: an inpainting one; `layered`: Qwen-Image-Layered's DiT and RGBA
    VAE; `zero_cond_t`: default `edit`, False for the one-image Edit)."""
    torch.manual_seed(0)
    config = qwen25_vl_7b_config(vision=edit)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval().requires_grad_(False)
        dit = QwenImageConfig(
            num_layers=layers,
            zero_cond_t=edit if zero_cond_t is None else zero_cond_t,
            use_additional_t_cond=layered,
            use_layer3d_rope=layered,
        )
        transformer = QwenImageTransformer(dit).eval().requires_grad_(False)
        vae = AutoencoderKLQwenImage(input_channels=4 if layered else 3).eval().requires_grad_(False)
        controlnet = None
        if controlnet_layers:
            mask_channels = 4 if controlnet_inpaints else 0  # the mask packed 2x2
            shape = ControlNetConfig(QwenImageConfig(num_layers=controlnet_layers), mask_channels)
            controlnet = QwenImageControlNet(shape).eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    transformer.post_load_weights()
    if controlnet is not None:
        controlnet.post_load_weights()
    parts = (build_qwen2_tokenizer(), text_encoder, transformer, vae, default_scheduler())
    return Components(*parts, controlnet=controlnet)


def control_request(work: Path, inpaint: bool) -> Request:
    """A calibration request guided by a 512x512 edge map (a square's outline) written into `work`; with
    `inpaint`, the map and the mask of its middle."""
    edges = np.zeros((512, 512), np.uint8)
    edges[128:384, [128, 383]] = edges[[128, 383], 128:384] = 255
    path, mask = work / "edges.png", work / "mask.png"
    Image.fromarray(edges).convert("RGB").save(path)
    if not inpaint:
        return Request("a house by a lake", control=(path,))
    middle = np.zeros((512, 512), np.uint8)
    middle[160:352, 160:352] = 255
    Image.fromarray(middle).save(mask)
    return Request("a house by a lake", control=(path,), control_mask=mask)


def qi21_model(layers: int, device: torch.device) -> QwenImage21Model:
    """A Qwen-Image 2.1 model with random weights at the released sizes, built on `device` in bf16."""
    torch.manual_seed(0)
    text = synthetic.text_encoder_config(synthetic.QWEN3_VL_8B_TEXT, synthetic.QWEN3_VL_8B_VISION)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        text_encoder = Qwen3VLForConditionalGeneration(text).eval().requires_grad_(False)
        transformer = (
            QwenImage21Transformer(QwenImage21Config(num_layers=layers)).eval().requires_grad_(False)
        )
        vae = AutoencoderKLQwenImage21().eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    transformer.post_load_weights()
    components = Components21(synthetic.processor(), text_encoder, transformer, vae, default_scheduler())
    return QwenImage21Model(components, device, torch.bfloat16)


def edit_model(
    components: Components,
    device: torch.device,
    work: Path,
    pipeline_class: str = "QwenImageEditPlusPipeline",
) -> QwenImageEditModel:
    """The components as an Edit-2511 (Plus) model, or the one-image Edit's `pipeline_class`, with the
    Qwen2-VL processor (default image settings, which are Qwen2.5-VL's: patch 14, merge 2, temporal patch 2)
    and the real tokenizer."""
    Qwen2VLImageProcessorPil().save_pretrained(work)
    components.tokenizer.save_pretrained(work)
    shared = {f.name: getattr(components, f.name) for f in fields(Components)}
    kind = EDIT_KINDS[pipeline_class]
    edit = EditComponents(**shared, processor=load_processor(work), kind=kind)
    return QwenImageEditModel(edit, device, torch.bfloat16)


def layered_model(components: Components, device: torch.device, work: Path) -> QwenImageLayeredModel:
    """The components as a Qwen-Image-Layered model, with the Qwen2-VL processor its pipeline lists."""
    Qwen2VLImageProcessorPil().save_pretrained(work)
    components.tokenizer.save_pretrained(work)
    shared = {f.name: getattr(components, f.name) for f in fields(Components)}
    layered = LayeredComponents(**shared, processor=load_processor(work))
    return QwenImageLayeredModel(layered, device, torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, help="transformer blocks (default: the model's, 60 or 32)")
    parser.add_argument("--bf16", action="store_true", help="write the BF16 checkpoint instead of FP8")
    parser.add_argument(
        "--fp8-modulation",
        action="store_true",
        help="the modulation FP8 weight-only (quantize --fp8-modulation)",
    )
    parser.add_argument(
        "--edit", action="store_true", help="an Edit-2511 checkpoint (zero_cond_t, processor)"
    )
    parser.add_argument(
        "--edit-single",
        action="store_true",
        help="with --edit: the one-image Edit (QwenImageEditPipeline, no zero_cond_t), which inpaints",
    )
    parser.add_argument("--nvfp4", action="store_true", help="write NVFP4 (quantize --format nvfp4) instead")
    parser.add_argument("--qi21", action="store_true", help="a Qwen-Image 2.1 checkpoint (32 layers)")
    parser.add_argument("--controlnet", type=int, default=0, metavar="N", help="add an N-block ControlNet")
    parser.add_argument("--inpaint", action="store_true", help="with --controlnet: an inpainting ControlNet")
    parser.add_argument("--layered", action="store_true", help="a Qwen-Image-Layered checkpoint")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.time()
    if args.qi21:
        model = qi21_model(args.layers or QwenImage21Config().num_layers, device)
        family, prompts = FAMILY21, ["a red fox in the snow"]
    else:
        layers = args.layers or QwenImageConfig().num_layers
        components = full_size_components(
            layers,
            device,
            args.edit,
            args.controlnet,
            args.inpaint,
            args.layered,
            zero_cond_t=False if args.edit_single else None,
        )
    print(f"built full-size random components in {time.time() - start:.0f} s", flush=True)
    if args.edit and args.edit_single:
        work = Path(tempfile.mkdtemp(prefix="processor_"))
        model = edit_model(components, device, work, "QwenImageEditPipeline")
        family, prompts = EDIT_FAMILY, edit_requests_for(1)[:2]
    elif args.edit:
        model = edit_model(components, device, Path(tempfile.mkdtemp(prefix="processor_")))
        requests = edit_requests_for(3)
        family, prompts = EDIT_FAMILY, [requests[0], requests[-1]]  # a one-image and a three-image pair
    elif args.layered:
        model = layered_model(components, device, Path(tempfile.mkdtemp(prefix="processor_")))
        family, prompts = LAYERED_FAMILY, edit_requests_for(1)[:2]
    elif not args.qi21:
        model = QwenImageModel(components, device, torch.bfloat16)
        family, prompts = FAMILY, ["a red fox in the snow"]
        if args.controlnet:
            family, prompts = (
                CONTROLNET_FAMILY,
                ["a red fox in the snow", control_request(Path(tempfile.mkdtemp()), args.inpaint)],
            )
    if args.bf16:
        model.save(args.out, (), GenerationDefaults())
    else:
        pipe = Pipeline.from_model(model, family.spec_for(model, "random-full-size", GenerationDefaults()))
        quantize_pipeline(
            pipe,
            args.out,
            prompts=prompts,
            steps=4,
            size=512,
            fp8_modulation=args.fp8_modulation,
            weights="nvfp4" if args.nvfp4 else "fp8",
        )
    print(f"wrote {args.out} in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
