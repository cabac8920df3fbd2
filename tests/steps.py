"""Test support: distances between bf16 or E4M3 tensors in representable steps (integer encodings).

Used by the kernel tests (CPU and GPU) to state "n steps apart" exactly: each encoding maps to an
integer that grows with the value (sign-magnitude to signed), so neighbours differ by 1 and +0 and -0
coincide. NaN matches only NaN.
"""

import torch

NAN_MISMATCH = 1 << 20  # distance reported where exactly one side is NaN

# dtype -> (integer view of the same size, sign bit, NaN test on the magnitude bits, mantissa bits)
_FORMATS = {
    torch.bfloat16: (torch.int16, 15, lambda mag: mag > 0x7F80, 7),
    torch.float8_e4m3fn: (torch.uint8, 7, lambda mag: mag == 0x7F, 3),
}


def ordered_codes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 code increasing with the value, NaN mask) of a bf16 or float8_e4m3fn tensor."""
    int_dtype, sign_bit, is_nan, _ = _FORMATS[t.dtype]
    bits = t.view(int_dtype).to(torch.int32) & ((1 << (sign_bit + 1)) - 1)
    mag = bits & ((1 << sign_bit) - 1)
    return torch.where(bits >> sign_bit == 1, -mag, mag), is_nan(mag)


def subnormal(t: torch.Tensor) -> torch.Tensor:
    """Mask of the nonzero bf16 / float8_e4m3fn values with a zero exponent field."""
    code, _ = ordered_codes(t)
    mag = code.abs()
    return (mag > 0) & (mag < (1 << _FORMATS[t.dtype][3]))


def step_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise |steps| between `a` and `b` (same dtype); 0 for NaN vs NaN, NAN_MISMATCH for one NaN."""
    code_a, nan_a = ordered_codes(a)
    code_b, nan_b = ordered_codes(b)
    dist = (code_a - code_b).abs()
    nan_dist = torch.where(nan_a & nan_b, 0, NAN_MISMATCH)
    return torch.where(nan_a | nan_b, nan_dist, dist)


def nudge_bf16(t: torch.Tensor, steps: int) -> torch.Tensor:
    """The bf16 values `steps` encodings above (negative: below) `t`."""
    code, _ = ordered_codes(t)
    code = code + steps
    bits = torch.where(code < 0, 0x8000 - code, code)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)
