"""Step-cache presets as plain data (the rule is models/step_cache.py); torch-free, so a front end checks
`--cache` before any model loads. Each preset is named for its trade-off; docs/DESIGN.md §13 and
BENCHMARKS.md give its measured quality and speed."""

from dataclasses import dataclass

from qwen_image_fusion.models.errors import InputError


@dataclass(frozen=True)
class CachePreset:
    """DBCache's knobs: the first `front_blocks` and last `back_blocks` blocks always run; the middle ones
    are skipped (their last residual reused) while the front blocks' residual changed by less than
    `threshold` (relative mean absolute difference) since the last call that ran them, except in the first
    `warmup_steps` steps and after `max_cached_in_a_row` skipped steps in a row."""

    name: str
    threshold: float
    front_blocks: int = 1
    back_blocks: int = 0
    warmup_steps: int = 2
    max_cached_in_a_row: int = 3

    def __post_init__(self) -> None:
        if not (self.threshold >= 0 and self.front_blocks >= 1 and self.back_blocks >= 0):
            raise InputError(f"cache {self.name!r}: threshold >= 0, front_blocks >= 1, back_blocks >= 0")
        if self.warmup_steps < 1 or self.max_cached_in_a_row < 1:
            raise InputError(f"cache {self.name!r}: warmup_steps and max_cached_in_a_row must be at least 1")

    def describe(self) -> str:
        """One line for --help, the UI and RunInfo."""
        return (
            f"{self.name}: F{self.front_blocks}B{self.back_blocks}, skip the middle blocks while the front "
            f"residual changes < {self.threshold:g}; {self.warmup_steps} warm-up steps, at most "
            f"{self.max_cached_in_a_row} skipped in a row"
        )


CACHE_OFF = "off"  # the name every front end gives "no cache" (every block runs)
CACHE_PRESETS: dict[str, CachePreset] = {
    p.name: p
    for p in (
        CachePreset("fast", threshold=0.12, warmup_steps=2, max_cached_in_a_row=2),
        CachePreset("faster", threshold=0.2, warmup_steps=2, max_cached_in_a_row=3),
    )
}


def get_cache_preset(cache: "str | CachePreset | None") -> CachePreset | None:
    """The preset named `cache` (a CachePreset passes through; None or "off": no cache); InputError names
    the known ones."""
    if cache is None or isinstance(cache, CachePreset):
        return cache
    if not isinstance(cache, str):
        raise InputError(f"cache must be a preset name ({', '.join(CACHE_PRESETS)}) or 'off'", "cache")
    if cache.strip().lower() in ("", CACHE_OFF, "none"):
        return None
    if cache not in CACHE_PRESETS:
        raise InputError(
            f"cache {cache!r} is not a step-cache preset ({', '.join(CACHE_PRESETS)}, or 'off')", "cache"
        )
    return CACHE_PRESETS[cache]
