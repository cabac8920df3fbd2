"""Per-pair image metrics: SHA256 (PNG bytes and raw pixels), PSNR, SSIM, absolute differences, LPIPS.

Images are uint8 RGB arrays of shape (H, W, 3). PSNR and SSIM come from scikit-image with a data
range of 255. LPIPS (AlexNet) is computed only from weights found on this machine; otherwise the
metric is reported unavailable with the reason, never estimated.
"""

import hashlib
import importlib.util
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

ALEXNET_CHECKPOINT = "alexnet-owt-7be5be79.pth"  # torchvision's file name in the torch hub cache
LPIPS_MIN_SIDE = 32  # AlexNet's pooling stack needs at least 32 px on each side


@dataclass
class ImageHashes:
    png_sha256: str
    pixel_sha256: str


@dataclass
class PairMetrics:
    """What one image pair measures; psnr_db is +inf for identical images."""

    a: ImageHashes
    b: ImageHashes
    identical: bool
    png_identical: bool
    psnr_db: float
    ssim: float
    lpips: float | None
    max_abs_diff: int
    mean_abs_diff: float


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_png(png: bytes) -> np.ndarray:
    """PNG bytes -> uint8 RGB array (H, W, 3)."""
    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def pixel_sha256(pixels: np.ndarray) -> str:
    """SHA256 of the raw uint8 RGB pixels in row-major (H, W, C) order."""
    return sha256_hex(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB over 0..255; +inf when the images are identical."""
    if np.array_equal(a, b):
        return math.inf
    return float(peak_signal_noise_ratio(a, b, data_range=255))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM over the RGB channels (scikit-image defaults: 7x7 uniform window)."""
    return float(structural_similarity(a, b, data_range=255, channel_axis=-1))


def abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16)).astype(np.uint8)


def diff_heatmap(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """Amplified difference as a black-red-yellow-white heatmap, and the gain applied.

    The per-pixel max channel difference is scaled so that the largest difference becomes full
    intensity, which makes even one-level differences visible.
    """
    diff = abs_diff(a, b).max(axis=-1).astype(np.float32)
    peak = float(diff.max())
    gain = 255.0 / peak if peak > 0 else 1.0
    v = diff * (gain / 255.0)
    rgb = np.stack([np.clip(3 * v, 0, 1), np.clip(3 * v - 1, 0, 1), np.clip(3 * v - 2, 0, 1)], axis=-1)
    return (rgb * 255).round().astype(np.uint8), gain


@dataclass
class Lpips:
    """LPIPS (AlexNet) scorer, or the reason it cannot run here (then `model` is None)."""

    model: object | None
    reason: str | None = None
    weights: str | None = None

    @property
    def available(self) -> bool:
        return self.model is not None

    def unavailable_for_size(self, width: int | None, height: int | None) -> "Lpips":
        """This scorer, or an unavailable one when the images are too small for AlexNet (None: each edit's
        input images decide its size, about 1024x1024 pixels)."""
        if (
            self.available
            and width is not None
            and height is not None
            and min(width, height) < LPIPS_MIN_SIDE
        ):
            reason = f"images of {width}x{height} are below AlexNet's {LPIPS_MIN_SIDE} px minimum"
            return Lpips(model=None, reason=reason, weights=self.weights)
        return self

    def score(self, a: np.ndarray, b: np.ndarray) -> float | None:
        if self.model is None:
            return None
        import torch

        def to_tensor(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(x).permute(2, 0, 1)[None].float() / 127.5 - 1.0

        with torch.no_grad():
            return float(self.model(to_tensor(a), to_tensor(b)).item())


def alexnet_weights_path(explicit: str | None) -> Path:
    """--lpips-weights when given, else torchvision's AlexNet checkpoint in the torch hub cache."""
    if explicit:
        return Path(explicit)
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_CHECKPOINT


def load_lpips(weights: str | None = None) -> Lpips:
    """Build LPIPS(net='alex') from local files only, or say why it is unavailable."""
    if importlib.util.find_spec("lpips") is None:
        return Lpips(model=None, reason="the lpips package is not installed")
    try:
        import torchvision  # noqa: F401  (lpips imports it at import time)
    except ImportError as exc:
        return Lpips(model=None, reason=f"torchvision is not importable ({exc}); lpips needs it")
    path = alexnet_weights_path(weights)
    if not path.is_file():
        reason = f"AlexNet weights not found at {path} (pass --lpips-weights PATH)"
        return Lpips(model=None, reason=reason, weights=str(path))
    import lpips
    import torch

    try:
        model = lpips.LPIPS(net="alex", pretrained=True, pnet_rand=True, verbose=False)
        state = torch.load(path, map_location="cpu", weights_only=True)
        load_alexnet_features(model.net, state)
    except Exception as exc:  # a broken or foreign checkpoint: report it rather than score with it
        return Lpips(model=None, reason=f"could not load LPIPS from {path}: {exc}", weights=str(path))
    return Lpips(model=model.eval(), weights=str(path))


def load_alexnet_features(net: object, state: dict) -> None:
    """Copy torchvision AlexNet `features.N.*` tensors into lpips' sliced copy (`sliceK.N.*`)."""
    targets = dict(net.named_parameters())
    missing = []
    for name, param in targets.items():
        _, index, leaf = name.split(".")
        source = state.get(f"features.{index}.{leaf}")
        if source is None or source.shape != param.shape:
            missing.append(f"features.{index}.{leaf}")
            continue
        param.data.copy_(source)
    if missing:
        raise ValueError(f"checkpoint lacks or mis-shapes {', '.join(missing)}")


def compare(png_a: bytes, png_b: bytes, lpips_scorer: Lpips) -> PairMetrics:
    """All metrics of one pair from the two PNG files' bytes."""
    a, b = decode_png(png_a), decode_png(png_b)
    if a.shape != b.shape:
        raise ValueError(f"image shapes differ: {a.shape} vs {b.shape}")
    diff = abs_diff(a, b)
    return PairMetrics(
        a=ImageHashes(sha256_hex(png_a), pixel_sha256(a)),
        b=ImageHashes(sha256_hex(png_b), pixel_sha256(b)),
        identical=bool(np.array_equal(a, b)),
        png_identical=png_a == png_b,
        psnr_db=psnr(a, b),
        ssim=ssim(a, b),
        lpips=lpips_scorer.score(a, b),
        max_abs_diff=int(diff.max()),
        mean_abs_diff=float(diff.mean()),
    )
