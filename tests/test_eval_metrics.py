"""qwen_image_fusion.eval.metrics on hand-made images with independently computed PSNR / SSIM, and the LPIPS
paths."""

import hashlib
import io
import math
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_image_fusion.eval import metrics


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def constant(value: int, size: int = 32) -> np.ndarray:
    return np.full((size, size, 3), value, dtype=np.uint8)


def test_psnr_of_constant_offset_matches_formula() -> None:
    for offset in (1, 3, 10, 50):
        expected = 10 * math.log10(255**2 / offset**2)  # MSE of a constant offset is offset^2
        assert metrics.psnr(constant(100), constant(100 + offset)) == pytest.approx(expected, abs=1e-9)


def test_psnr_is_inf_for_identical_images() -> None:
    image = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    assert metrics.psnr(image, image.copy()) == math.inf


def test_ssim_of_constant_images_is_the_luminance_term() -> None:
    c1 = (0.01 * 255) ** 2  # no variance, so only SSIM's luminance term remains
    for a, b in ((100, 100), (100, 110), (20, 200)):
        expected = (2 * a * b + c1) / (a * a + b * b + c1)
        assert metrics.ssim(constant(a), constant(b)) == pytest.approx(expected, abs=1e-9)


def test_compare_hashes_and_differences() -> None:
    a = np.random.default_rng(1).integers(0, 250, (32, 48, 3), dtype=np.uint8)
    b = a.copy()
    b[0, 0, 0] += 5
    b[3, 4, 2] += 1
    png_a, png_b = png(a), png(b)
    result = metrics.compare(png_a, png_b, metrics.Lpips(model=None, reason="test"))
    assert result.a.png_sha256 == hashlib.sha256(png_a).hexdigest()
    assert result.a.pixel_sha256 == hashlib.sha256(a.tobytes()).hexdigest()
    assert result.b.pixel_sha256 != result.a.pixel_sha256
    assert not result.identical and not result.png_identical
    assert result.max_abs_diff == 5
    assert result.mean_abs_diff == pytest.approx(6 / a.size)
    assert result.psnr_db == pytest.approx(10 * math.log10(255**2 / (26 / a.size)))
    assert result.lpips is None
    same = metrics.compare(png_a, png(a.copy()), metrics.Lpips(model=None, reason="test"))
    assert same.identical and same.png_identical and same.psnr_db == math.inf and same.max_abs_diff == 0


def test_compare_rejects_different_shapes() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.compare(png(constant(1, 16)), png(constant(1, 32)), metrics.Lpips(model=None))


def test_diff_heatmap_amplifies_the_largest_difference_to_white() -> None:
    a = constant(10, 16)
    b = a.copy()
    b[2, 3] = (12, 10, 10)
    heatmap, gain = metrics.diff_heatmap(a, b)
    assert gain == pytest.approx(255 / 2)
    assert heatmap.shape == (16, 16, 3) and heatmap.dtype == np.uint8
    assert tuple(heatmap[2, 3]) == (255, 255, 255)
    assert heatmap.sum() == 3 * 255


def test_lpips_unavailable_without_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes `import torchvision` fail
    scorer = metrics.load_lpips()
    assert not scorer.available
    assert "torchvision" in scorer.reason
    assert scorer.score(constant(1), constant(2)) is None


def alexnet_features() -> torch.nn.Sequential:
    """torchvision's AlexNet `features` layout (the part LPIPS uses)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
    )  # fmt: skip


@pytest.fixture
def stand_in_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    """A minimal torchvision exposing models.alexnet, so lpips imports without the real package."""
    models = types.ModuleType("torchvision.models")
    models.alexnet = lambda pretrained=False: types.SimpleNamespace(features=alexnet_features())
    package = types.ModuleType("torchvision")
    package.models = models
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    yield
    for name in [name for name in sys.modules if name == "lpips" or name.startswith("lpips.")]:
        del sys.modules[name]


def test_lpips_missing_weights_names_the_path(stand_in_torchvision: None, tmp_path) -> None:
    scorer = metrics.load_lpips(str(tmp_path / "alexnet.pth"))
    assert not scorer.available
    assert "AlexNet weights not found" in scorer.reason and str(tmp_path) in scorer.reason


def test_lpips_loads_local_alexnet_weights(stand_in_torchvision: None, tmp_path) -> None:
    torch.manual_seed(0)
    state = {f"features.{k}": v for k, v in alexnet_features().state_dict().items()}
    path = tmp_path / "alexnet.pth"
    torch.save(state, path)
    scorer = metrics.load_lpips(str(path))
    assert scorer.available, scorer.reason
    assert scorer.model.net.slice1[0].weight.equal(state["features.0.weight"])
    assert scorer.model.net.slice5[0].bias.equal(state["features.10.bias"])
    image = np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert scorer.score(image, image) == pytest.approx(0.0, abs=1e-7)
    assert scorer.score(image, 255 - image) > 0
    small = scorer.unavailable_for_size(16, 64)
    assert not small.available and "32 px" in small.reason


def test_lpips_rejects_a_foreign_checkpoint(stand_in_torchvision: None, tmp_path) -> None:
    path = tmp_path / "other.pth"
    torch.save({"classifier.1.weight": torch.zeros(2)}, path)
    scorer = metrics.load_lpips(str(path))
    assert not scorer.available and "features.0.weight" in scorer.reason
