"""--expect: the verdict a run must reach, checked on every pair.

Grammar: comma-separated terms, each `identical` or `METRIC OP NUMBER`.
  METRIC  psnr (dB; identical pairs count as inf), ssim, lpips, max_abs, mean_abs (0..255 levels)
  OP      >=, >, <=, <, ==
Examples: `identical`, `psnr>=35,ssim>=0.98`, `max_abs<=2`, `lpips<0.01`.
"""

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

from qwen_image_fusion.models.errors import InputError

METRICS = {
    "psnr": "psnr_db",
    "ssim": "ssim",
    "lpips": "lpips",
    "max_abs": "max_abs_diff",
    "mean_abs": "mean_abs_diff",
}
OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    ">": operator.gt,
    "<": operator.lt,
}
TERM = re.compile(r"^\s*([a-z_]+)\s*(>=|<=|==|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|inf)\s*$")


@dataclass(frozen=True)
class Term:
    """One condition; metric None means `identical`."""

    text: str
    metric: str | None = None
    op: str | None = None
    value: float | None = None

    def holds(self, pair: dict) -> bool:
        if self.metric is None:
            return pair["identical"]
        got = pair[METRICS[self.metric]]
        return got is not None and OPS[self.op](got, self.value)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    line: str
    failures: list[str]


def parse_expect(text: str) -> list[Term]:
    """Parse an --expect string. Raises InputError on bad syntax."""
    terms = []
    for raw in text.split(","):
        item = raw.strip().lower()
        if item == "identical":
            terms.append(Term(text="identical"))
            continue
        match = TERM.match(item)
        if not match or match.group(1) not in METRICS:
            raise InputError(
                f"bad --expect term {raw.strip()!r}: use 'identical' or METRIC OP NUMBER "
                f"(METRIC: {', '.join(METRICS)}; OP: >=, >, <=, <, ==), comma-separated"
            )
        metric, op, value = match.groups()
        terms.append(Term(text=f"{metric}{op}{value}", metric=metric, op=op, value=float(value)))
    return terms


def worst(term: Term, failing: list[dict]) -> dict:
    """The failing pair farthest from the bound (the lowest value for >= and >, else the highest)."""
    key = METRICS[term.metric]

    def badness(pair: dict) -> float:
        got = pair[key]
        if got is None:
            return math.inf
        return -got if term.op in (">=", ">") else got

    return max(failing, key=badness)


def describe(term: Term, failing: list[dict], total: int) -> str:
    text = f"{term.text} failed on {len(failing)}/{total} pairs"
    if term.metric is None:
        return f"{text} (first: {failing[0]['id']})"
    pair = worst(term, failing)
    got = pair[METRICS[term.metric]]
    shown = "unavailable" if got is None else f"{got:.6g}"
    return f"{text} (worst: {shown} at {pair['id']})"


def judge(terms: list[Term], pairs: list[dict]) -> Verdict:
    """Check every term on every pair; the verdict line says what failed, worst pair first."""
    failures = []
    for term in terms:
        failing = [pair for pair in pairs if not term.holds(pair)]
        if failing:
            failures.append(describe(term, failing, len(pairs)))
    spec = ",".join(term.text for term in terms)
    if failures:
        return Verdict(False, f"verdict: FAIL ({'; '.join(failures)})", failures)
    return Verdict(True, f"verdict: PASS ({spec} on all {len(pairs)} pairs)", failures)
