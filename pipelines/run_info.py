"""What a request's run did, recorded by the stage that decided it: seed, size, variant, seconds per stage,
the steps a step cache skipped and how the VAE decoded. Every summary (CLI, HTTP response, demo, eval
report) prints from a `RunInfo`, never from what the request asked."""

import time
from dataclasses import dataclass, field

import PIL.Image
import torch

from qwen_image_fusion.models.cache_presets import CachePreset
from qwen_image_fusion.models.step_cache import BranchCache
from qwen_image_fusion.models.vae_decode import DecodeReport

BRANCH_NAMES = ("positive", "negative")  # CFG branches in the order the denoise loop runs them


@dataclass(frozen=True)
class CacheReport:
    """A step cache's run: its preset, the steps of the request, whether it ran true CFG, and per CFG branch
    this process ran (a CFG-parallel rank runs one) the steps whose middle blocks were skipped, one count
    per image row."""

    preset: str
    steps: int
    skipped: dict[str, tuple[int, ...]]
    cfg: bool = False

    def mean_skipped(self, branch: str = "positive") -> float:
        """Steps skipped in `branch`, the mean over the request's rows."""
        counts = self.skipped[branch]
        return sum(counts) / len(counts)

    def summary(self) -> str:
        parts = [
            f"{self.mean_skipped(name):g} of {self.steps}" + (f" ({name})" if self.cfg else "")
            for name in self.skipped
        ]
        return f"{self.preset}: middle blocks skipped in {', '.join(parts)} steps"


@dataclass
class RunInfo:
    """What one request's run did: seed, size, variant, seconds per stage, and the approximate paths that
    ran (`cache`, `decode`)."""

    seed: int | list[int]
    width: int
    height: int
    num_inference_steps: int  # the steps that ran (img2img: the `strength` share of those asked for)
    variant: str
    fusion_summary: str
    timings: dict[str, float] = field(default_factory=dict)
    preset: str = ""
    loras: str = ""  # the LoRAs that ran, with scales and mode ("" without LoRA)
    shared_by: int = 1  # requests that shared its denoising steps (their seconds are in each one's timings)
    cache: CacheReport | None = None  # the step cache's skips (None: every block ran)
    caption: str = ""  # the model's caption that stood for an empty prompt ("" when none did)
    decode: DecodeReport | None = None  # how the VAE decoded (None: latents returned, nothing decoded)

    @property
    def ms_per_step(self) -> float:
        return 1000.0 * self.timings.get("denoising", 0.0) / max(self.num_inference_steps, 1)

    def approximations(self) -> dict[str, str]:
        """What a summary must say beside the images, by label: the step cache that ran (approximate) and a
        decode that ran in the 2D form or fell back from it."""
        lines = {}
        if self.cache is not None:
            lines["Step cache"] = f"{self.cache.summary()} (approximate)"
        if self.decode is not None and (self.decode.fast or self.decode.fallback):
            lines["Decode"] = self.decode.summary()
        return lines


@dataclass
class Generated:
    """One request's images (or final packed latents) and what its run did."""

    images: list[PIL.Image.Image] | torch.Tensor
    info: RunInfo


class StageTimer:
    """Wall-clock seconds per stage, synchronizing CUDA so each lap is real."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.timings: dict[str, float] = {}
        self.start = self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.timings[name] = now - self.last
        self.last = now


def cache_report(
    preset: CachePreset | None, caches: list[BranchCache] | None, first_row: int, rows: int, steps: int
) -> CacheReport | None:
    """The cache report of a request's rows `first_row`.. of a denoise loop run with step `caches` (None
    without a cache)."""
    if preset is None or not caches:
        return None
    names = BRANCH_NAMES if len(caches) == 2 else BRANCH_NAMES[:1]
    skipped = {
        name: tuple(cache.skipped[first_row : first_row + rows])
        for name, cache in zip(names, caches, strict=True)
        if cache.skipped[first_row : first_row + rows]
    }
    return CacheReport(preset.name, steps, skipped, cfg=len(caches) == 2) if skipped else None
