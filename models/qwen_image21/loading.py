"""Loading a diffusers-layout Qwen-Image 2.1 transformer directory (BF16 or ModelOpt FP8)."""

from pathlib import Path

import torch

from models.loading import read_hf_quant_config, read_json, read_state_dict, transformer_from_state
from models.modelopt import parse_quant_config
from models.qwen_image21.config import QwenImage21Config
from models.qwen_image21.transformer import QwenImage21Transformer


def load_transformer21(
    directory: Path, dtype: torch.dtype, device: torch.device | str
) -> QwenImage21Transformer:
    """Build the 2.1 transformer of `directory` on `device` without a random init, after `post_load_weights`.

    A bad config value, a missing, unexpected or misshapen tensor, or a broken FP8 layer is refused with one
    line (`CheckpointError`) naming it.
    """
    directory = Path(directory)
    raw = read_json(directory / "config.json")
    config = QwenImage21Config.from_dict(raw)
    quant = parse_quant_config(raw, read_hf_quant_config(directory))
    origins: dict[str, Path] = {}
    state = read_state_dict(directory, device, origins)
    return transformer_from_state(
        config, state, quant, dtype, directory, origins, model_class=QwenImage21Transformer
    )
