"""ControlNet checkpoints for the tests: the embedded default model plus a `controlnet/` folder written by
diffusers' own `QwenImageControlNetModel` (random weights, its zero-initialised projections filled too, so
the residuals matter), and control maps the project does not draw elsewhere."""

import json
import shutil
from pathlib import Path

import numpy as np
import PIL.Image
from diffusers import QwenImageControlNetModel
from helpers import fill_deterministic

from qwen_image_fusion.models.checkpoint import read_json
from qwen_image_fusion.models.embedded import DEFAULT_MODEL_DIR

CONFIG_KEYS = ("attention_head_dim", "num_attention_heads", "joint_attention_dim", "axes_dims_rope")


def build_controlnet_checkpoint(
    directory: Path, layers: int = 2, seed: int = 3, inpaint: bool = False
) -> Path:
    """A QwenImageControlNetPipeline checkpoint: the embedded default with a `layers`-block ControlNet
    (`inpaint`: a QwenImageControlNetInpaintPipeline one, whose ControlNet also reads the packed mask)."""
    shutil.copytree(DEFAULT_MODEL_DIR, directory, ignore=shutil.ignore_patterns("training"))
    transformer = read_json(directory / "transformer" / "config.json")
    shape = {k: transformer[k] for k in CONFIG_KEYS}
    net = QwenImageControlNetModel(num_layers=layers, extra_condition_channels=4 if inpaint else 0, **shape)
    fill_deterministic(net, seed)
    net.save_pretrained(directory / "controlnet")
    index = read_json(directory / "model_index.json")
    index["_class_name"] = "QwenImageControlNetInpaintPipeline" if inpaint else "QwenImageControlNetPipeline"
    index["controlnet"] = ["diffusers", "QwenImageControlNetModel"]
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))
    return directory


def edge_map(width: int, height: int, seed: int = 0) -> PIL.Image.Image:
    """White outlines of random rectangles and a circle on black, like a canny map."""
    rng = np.random.default_rng(seed)
    canvas = np.zeros((height, width), dtype=np.uint8)
    for _ in range(4):
        x0, y0 = rng.integers(0, width // 2), rng.integers(0, height // 2)
        x1, y1 = x0 + rng.integers(8, width // 2), y0 + rng.integers(8, height // 2)
        canvas[y0:y1, [x0, min(x1, width - 1)]] = 255
        canvas[[y0, min(y1, height - 1)], x0:x1] = 255
    y, x = np.mgrid[0:height, 0:width]
    ring = np.abs(np.hypot(x - 0.6 * width, y - 0.5 * height) - 0.25 * min(width, height)) < 1.0
    canvas[ring] = 255
    return PIL.Image.fromarray(canvas).convert("RGB")


def depth_map(width: int, height: int) -> PIL.Image.Image:
    """A smooth grey ramp with a nearer disc, like a depth estimate."""
    y, x = np.mgrid[0:height, 0:width]
    depth = 60 + 120 * y / height
    disc = np.hypot(x - 0.35 * width, y - 0.45 * height) < 0.2 * min(width, height)
    depth[disc] = 230
    return PIL.Image.fromarray(depth.astype(np.uint8)).convert("RGB")
