"""Random LoRA files in the layouts users bring (diffusers/PEFT, kohya, ComfyUI, the Lightning release), and
the diffusers pipeline and shared-pipeline fixture the LoRA tests compare against.

Each writer takes factors by diffusers module name ({module: (down [r, in], up [out, r])}) and lays them
out as that tool does; the key layouts follow the files in the wild (e.g. the Lightning release's
`transformer_blocks.N.<module>.lora_down.weight` / `.lora_up.weight` / `.alpha`, as
ModelTC/Qwen-Image-Lightning's generate_with_diffusers.py reads them).
"""

from collections.abc import Iterator
from pathlib import Path

import torch
from diffusers import QwenImagePipeline as DiffusersQwenImagePipeline
from safetensors.torch import save_file
from torch import nn

Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]
BLOCK_LINEARS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_out.0",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
    "img_mod.1",
    "txt_mod.1",
)


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear of a transformer, wrapped or not, by module name."""
    from qwen_image_fusion.models.lora import lora_targets

    return {name: (m.in_features, m.out_features) for name, m in lora_targets(model).items()}


def block_modules(num_layers: int, names: tuple[str, ...] = BLOCK_LINEARS) -> list[str]:
    return [f"transformer_blocks.{i}.{name}" for i in range(num_layers) for name in names]


def random_factors(
    shapes: dict[str, tuple[int, int]],
    modules: list[str],
    rank: int | dict[str, int],
    seed: int,
    std: float = 0.15,
    dtype: torch.dtype = torch.float32,
) -> Factors:
    """Seeded random down/up factors for `modules` (rank per module when a dict)."""
    gen = torch.Generator().manual_seed(seed)
    factors = {}
    for module in modules:
        fan_in, fan_out = shapes[module]
        r = rank[module] if isinstance(rank, dict) else rank
        down = torch.randn(r, fan_in, generator=gen) * std
        up = torch.randn(fan_out, r, generator=gen) * std
        factors[module] = (down.to(dtype), up.to(dtype))
    return factors


def write_peft(path: Path, factors: Factors, prefix: str = "transformer.") -> Path:
    """diffusers / PEFT keys: `transformer.<module>.lora_A.weight` / `.lora_B.weight`, no alpha."""
    tensors = {}
    for module, (down, up) in factors.items():
        tensors[f"{prefix}{module}.lora_A.weight"] = down
        tensors[f"{prefix}{module}.lora_B.weight"] = up
    save_file(tensors, path)
    return path


def write_diffusers_with_metadata(directory: Path, factors: Factors, config: dict) -> Path:
    """What diffusers' `save_lora_weights` writes, with the LoraConfig in the safetensors header."""
    layers = {}
    for module, (down, up) in factors.items():
        layers[f"{module}.lora_A.weight"] = down
        layers[f"{module}.lora_B.weight"] = up
    DiffusersQwenImagePipeline.save_lora_weights(
        directory, transformer_lora_layers=layers, transformer_lora_adapter_metadata=config
    )
    return directory / "pytorch_lora_weights.safetensors"


def _down_up_alpha(key: str, down: torch.Tensor, up: torch.Tensor, alpha: float | None) -> dict:
    tensors = {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up}
    if alpha is not None:
        tensors[f"{key}.alpha"] = torch.tensor(alpha, dtype=down.dtype)
    return tensors


def write_kohya(path: Path, factors: Factors, alpha: float) -> Path:
    """kohya / musubi keys: `lora_unet_<module, _ for .>.lora_down.weight`, `.lora_up.weight`, `.alpha`."""
    tensors = {}
    for module, (down, up) in factors.items():
        tensors |= _down_up_alpha("lora_unet_" + module.replace(".", "_"), down, up, alpha)
    save_file(tensors, path)
    return path


def write_comfy(path: Path, factors: Factors, alpha: float) -> Path:
    """ComfyUI keys: `diffusion_model.<module>.lora_down.weight`, `.lora_up.weight`, `.alpha`."""
    tensors = {}
    for module, (down, up) in factors.items():
        tensors |= _down_up_alpha(f"diffusion_model.{module}", down, up, alpha)
    save_file(tensors, path)
    return path


def write_lightning(path: Path, factors: Factors, alpha: float) -> Path:
    """The Lightning release layout: `transformer_blocks.N.<module>.lora_down.weight` / `.lora_up.weight`
    / `.alpha` (no prefix; alpha below the rank, e.g. rank 64 with alpha 8 in the public files)."""
    tensors = {}
    for module, (down, up) in factors.items():
        tensors |= _down_up_alpha(module, down, up, alpha)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def metadata_config(modules: list[str], rank: int, alpha: float, **patterns: dict) -> dict:
    """A LoraConfig as diffusers' training scripts store it (`rank_pattern` / `alpha_pattern` optional)."""
    return {"r": rank, "lora_alpha": alpha, "target_modules": modules, **patterns}


def shared_pipeline(pipe, variant: str) -> Iterator:
    """Yield a module-wide pipeline to one test, then unload its LoRAs and restore mode and variant."""
    yield pipe
    pipe.unload_lora()
    pipe.set_lora_mode("branch")
    pipe.set_variant(variant)
