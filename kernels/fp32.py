"""fp32 arithmetic whose bytes do not depend on the machine: the building blocks of the torch twins.

torch's own CPU ops round differently from machine to machine where they are not plain IEEE operations:
`torch.sqrt` (torch 2.13 on an AMD EPYC with AVX2: one ulp off in about 1 of 5 float32 inputs and
1 of 80 float64 ones), `torch.tanh` and `torch.exp`, and every reduction (`.sum()` splits a row
differently with 1 or 2 threads and with 8- or 16-lane vectors). What every CPU and GPU does alike:
IEEE add, subtract, multiply and divide of two tensors, comparisons, and conversions between float
formats (each rounded to nearest-even). The twins of DESIGN §4 are built from those alone:

- `row_sum`: sums in one fixed order, made of elementwise adds;
- `sqrt_rn`: the correctly rounded square root, from any float64 square root within one float32 step
  of the exact one, settled by exact float64 products;
- `div_rn`: IEEE division by a tensor divisor on the same device (a Python-scalar divisor is avoided:
  CUDA turns it into a multiply by the rounded reciprocal).
"""

import torch


def row_sum(v: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dim in a pinned order, shaped [..., 1]: while the width w is above 1, the
    last floor(w/2) columns are added onto the first ones (column i + ceil(w/2) onto column i) and
    w becomes ceil(w/2). Every step is an elementwise IEEE add, so any machine, thread count or vector
    width gives the same bits. The width must be at least 1."""
    while (width := v.shape[-1]) > 1:
        half = (width + 1) // 2
        folded = v[..., : width - half] + v[..., half:]
        v = folded if width % 2 == 0 else torch.cat([folded, v[..., width - half : half]], dim=-1)
    return v


def div_rn(numerator: torch.Tensor, denominator: torch.Tensor | float) -> torch.Tensor:
    """IEEE `numerator / denominator` in fp32. A scalar denominator becomes a tensor on the numerator's
    device first (rounded to fp32, as torch rounds a Python scalar), so no backend multiplies by a
    reciprocal instead."""
    if not isinstance(denominator, torch.Tensor):
        denominator = torch.full_like(numerator, denominator)
    return numerator / denominator


def _settle_sqrt(candidate: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root of fp32 `v`, from a `candidate` within one fp32 step of it.

    The exact root of an fp32 number is never an fp32 midpoint (a midpoint has 25 significant bits, its
    square 49 or 50, never an fp32 number), so the neighbour whose midpoint with the candidate the root
    passes is the answer. Midpoints (25 bits) and their squares (at most 50 bits, between 2^-300 and
    2^256) are exact in float64, so the test is exact on every machine. NaN, inf and zeros pass through.
    """
    wide = v.double()
    above = torch.nextafter(candidate, torch.full_like(candidate, torch.inf))
    below = torch.nextafter(candidate, torch.zeros_like(candidate))
    mid_above = (candidate.double() + above.double()) * 0.5
    mid_below = (candidate.double() + below.double()) * 0.5
    settled = torch.where(mid_below * mid_below > wide, below, candidate)
    return torch.where(mid_above * mid_above < wide, above, settled)


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """IEEE (correctly rounded) fp32 square root of fp32 `v`, whatever `torch.sqrt`'s accuracy here.

    The candidate is torch's float64 root rounded to fp32. It is already right unless that root is off
    by 4 float64 ulps or more: scaled to [2^23, 2^24), where fp32 steps are 1, the root s of an fp32 x
    (an integer there) is |m^2 - x| / (m + s) >= (1/4) / 2^25 = 2^-27 = 4 float64 ulps from every
    midpoint m = k + 1/2. `_settle_sqrt` makes it right whenever it is within one fp32 step.
    """
    return _settle_sqrt(torch.sqrt(v.double()).float(), v)
