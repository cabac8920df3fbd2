"""One variant's denoise-step timings on the full-size Qwen-Image DiT with random weights (one process).

Prints one JSON line per (size, batch) config. `bench/run_bench.py` runs the variants in separate
processes in a balanced order and writes the tables. FP8 and NVFP4 scales come from a short calibration
on random inputs (`--layers` smaller than 60 for quick trials). `nvfp4` is the NVFP4 weight path with
quantize's default BF16 rules (the first two and last two blocks, everything outside the blocks);
`nvfp4all` quantizes every block. `build` also takes a Qwen-Image 2.1 config (its own DiT, its family's
recipe; not the diffusers variants): bench/profile_step.py's requests build each family's DiT through it.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from qwen_image_fusion.models.calibration import nvfp4_state_dict, record_input_amax
from qwen_image_fusion.models.family import QuantRecipe
from qwen_image_fusion.models.loading import transformer_from_state
from qwen_image_fusion.models.modelopt import QuantConfig
from qwen_image_fusion.models.qwen_image.config import QwenImageConfig
from qwen_image_fusion.models.qwen_image.model import QUANTIZATION
from qwen_image_fusion.models.qwen_image.transformer import QwenImageTransformer
from qwen_image_fusion.models.qwen_image21.checkpoint import SLOT_TOKENS
from qwen_image_fusion.models.qwen_image21.config import QwenImage21Config
from qwen_image_fusion.models.qwen_image21.quantization import QUANTIZATION as QUANTIZATION21
from qwen_image_fusion.models.qwen_image21.transformer import QwenImage21Transformer
from qwen_image_fusion.pipelines.quantize import (
    fp8_state_dict,
    nvfp4_fallback,
    quantizable_linears,
    share_group_amax,
)

DEFAULT_BF16_FALLBACK = QUANTIZATION.bf16_fallback
DitConfig = QwenImageConfig | QwenImage21Config

VARIANTS = (
    "diffusers",
    "diffusers-compile",
    "diffusers-torchao",
    "reference",
    "contract",
    "fp8-unfused",
    "fp8-fused",
    "fp8all-unfused",
    "fp8all-fused",
    "nvfp4",
    "nvfp4all",
)


def step_inputs(config: QwenImageConfig, size: int, batch: int, text: int, device: torch.device):
    """Random latents/prompt embeddings for one step at `size` x `size` pixels."""
    grid = (1, size // 16, size // 16)
    gen = torch.Generator(device).manual_seed(0)
    latents = torch.randn(batch, grid[1] * grid[2], config.in_channels, generator=gen, device=device)
    prompt = torch.randn(batch, text, config.joint_attention_dim, generator=gen, device=device)
    sigma = torch.full((batch,), 0.6, device=device)
    return latents.bfloat16(), prompt.bfloat16(), sigma, grid


def family_of(config: DitConfig) -> tuple[type[torch.nn.Module], QuantRecipe]:
    """The DiT class of a config and its family's quantize recipe: Qwen-Image's (text to image, and Edit-2511
    with `zero_cond_t`) or 2.1's."""
    if isinstance(config, QwenImage21Config):
        return QwenImage21Transformer, QUANTIZATION21
    return QwenImageTransformer, QUANTIZATION


def qi21_layout(model: QwenImage21Transformer, size: int, batch: int, text: int):
    """The token layout of a 2.1 text-to-image request at `size` x `size` pixels with `text` prompt tokens:
    the prompt's slots, then the target's (16x VAE, one latent token per 16 pixels)."""
    target = (size // 16) ** 2 // SLOT_TOKENS
    slots = (torch.zeros(batch, text, dtype=torch.bool), torch.ones(batch, target, dtype=torch.bool))
    img_mask = torch.cat(slots, dim=1)
    return model.layout(img_mask, [(1, size // 16, size // 16)])


def random_forward(model: torch.nn.Module, size: int, batch: int, text: int, device: torch.device) -> None:
    """One forward of either family's DiT on random inputs (text to image, a full pass)."""
    config = model.config
    if isinstance(config, QwenImage21Config):
        gen = torch.Generator(device).manual_seed(0)
        layout = qi21_layout(model, size, batch, text)
        latents = torch.randn(batch, layout.image_len, config.in_channels, generator=gen, device=device)
        prompt = torch.randn(batch, text, config.context_in_dim, generator=gen, device=device)
        model(latents.bfloat16(), prompt.bfloat16(), torch.full((batch,), 0.6, device=device), layout)
        return
    latents, prompt, sigma, grid = step_inputs(config, size, batch, text, device)
    model(latents, prompt, None, sigma, grid)


def calibrate_random(model: torch.nn.Module, linears: dict, device: torch.device, size: int = 512):
    """Input amax of each linear over one forward on random inputs."""
    with torch.no_grad(), record_input_amax(linears) as amax:
        random_forward(model, size, 1, 64, device)
    return amax


def diffusers_model(
    variant: str, model: QwenImageTransformer, config: QwenImageConfig, device: torch.device
) -> torch.nn.Module:
    """diffusers' transformer on `model`'s weights; `-compile`: regional torch.compile of the blocks;
    `-torchao`: also torchao float8 dynamic per-tensor on the block linears outside the default BF16
    fallback list (the DESIGN §5 baseline), compiled the same way."""
    from diffusers import QwenImageTransformer2DModel

    kwargs = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
    with torch.device("meta"):
        ref = QwenImageTransformer2DModel(**kwargs)
    ref.load_state_dict(model.state_dict(), assign=True)
    ref.pos_embed = type(ref.pos_embed)(theta=10000, axes_dim=list(config.axes_dims_rope), scale_rope=True)
    ref = ref.to(device).eval()
    if variant == "diffusers-torchao":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerTensor, quantize_

        fallback = QuantConfig("FP8", DEFAULT_BF16_FALLBACK)
        quantize_(
            ref,
            Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
            filter_fn=lambda module, name: (
                isinstance(module, torch.nn.Linear)
                and name.startswith("transformer_blocks.")
                and not fallback.ignores(name)
            ),
        )
    if variant != "diffusers":
        ref.compile_repeated_blocks(fullgraph=True)
    return ref


def build(
    variant: str, config: DitConfig, device: torch.device, calibration_size: int = 512
) -> torch.nn.Module:
    """The model to time: ours (BF16 or FP8) or diffusers' on identical random weights; the DiT and its
    recipe by the config's family (`family_of`). FP8/NVFP4 scales from one forward at `calibration_size`."""
    transformer, recipe = family_of(config)
    if variant.startswith("diffusers") and transformer is not QwenImageTransformer:
        raise ValueError(f"{variant}: the diffusers variants are Qwen-Image's only")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = transformer(config).eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    if variant.startswith("diffusers"):
        return diffusers_model(variant, model, config, device)
    if variant in ("reference", "contract"):
        model.set_numerics(variant)
        return model
    if variant.startswith("nvfp4"):
        ignore = nvfp4_fallback(recipe, model) if variant == "nvfp4" else recipe.outside_blocks
    else:
        ignore = recipe.bf16_fallback if variant.startswith("fp8-") else recipe.all_blocks_fp8
    linears = quantizable_linears(model, ignore)
    amax = share_group_amax(calibrate_random(model, linears, device, calibration_size), recipe.shared_inputs)
    if variant.startswith("nvfp4"):
        state, quant = (
            nvfp4_state_dict(model, linears, amax),
            QuantConfig("NVFP4", tuple(ignore), group_size=16),
        )
    else:
        state, quant = fp8_state_dict(model, linears, amax), QuantConfig("FP8", tuple(ignore))
    del model, linears
    torch.cuda.empty_cache()
    with torch.device("meta"):
        meta = transformer(config)
    quantized = transformer_from_state(meta, state, quant, torch.bfloat16, Path("random"))
    if variant.startswith("nvfp4"):
        quantized.set_numerics("contract")  # the nvfp4 variant: contract producers, BF16 activations
    else:
        quantized.post_load_weights(fuse=variant.endswith("-fused"))
    return quantized


def time_step(model, variant: str, inputs, runs: int, warmup: int, graph: bool) -> list[float]:
    latents, prompt, sigma, grid = inputs
    if variant.startswith("diffusers"):

        def step():
            return model(
                hidden_states=latents,
                encoder_hidden_states=prompt,
                timestep=sigma,
                img_shapes=[[grid]] * latents.shape[0],
                return_dict=False,
            )[0]
    elif graph:
        from qwen_image_fusion.pipelines.cuda_graph import GraphedStep

        graphed = GraphedStep(lambda lat, emb, sig: model(lat, emb, None, sig, grid))

        def step():
            return graphed(latents, prompt, sigma)
    else:

        def step():
            return model(latents, prompt, None, sigma, grid)

    times = []
    with torch.no_grad():
        for i in range(warmup + runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--configs", default="1024x1,1024x2,1328x2", help="SIZExBATCH list")
    parser.add_argument("--text", type=int, default=128)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--graph", action="store_true", help="replay the step as a captured CUDA graph")
    args = parser.parse_args()
    device = torch.device("cuda")
    config = QwenImageConfig(num_layers=args.layers)
    model = build(args.variant, config, device)
    report = getattr(model, "fusion_report", None)
    for item in args.configs.split(","):
        size, batch = (int(v) for v in item.split("x"))
        inputs = step_inputs(config, size, batch, args.text, device)
        times = time_step(model, args.variant, inputs, args.runs, args.warmup, args.graph)
        row = {
            "variant": args.variant + ("+graph" if args.graph else ""),
            "size": size,
            "batch": batch,
            "text": args.text,
            "layers": args.layers,
            "ms": times,
            "median_ms": statistics.median(times),
            "fusion_summary": report.summary().splitlines()[0] if report else "",
        }
        print(json.dumps(row), flush=True)
    print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", file=sys.stderr)


if __name__ == "__main__":
    main()
