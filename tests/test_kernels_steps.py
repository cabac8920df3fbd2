"""The step-distance helpers the kernel tests rely on, checked against torch's own float ordering."""

import torch
from steps import NAN_MISMATCH, nudge_bf16, ordered_codes, step_distance, subnormal


def all_bf16() -> torch.Tensor:
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_codes_follow_value_order_for_every_bf16_and_fp8_encoding():
    for values in (all_bf16(), torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)):
        codes, nan = ordered_codes(values)
        as_float = values.float()
        assert torch.equal(nan, as_float.isnan())
        order = torch.argsort(as_float[~nan], stable=True)
        sorted_codes = codes[~nan][order]
        steps = sorted_codes[1:] - sorted_codes[:-1]
        # neighbours in value are one code apart; +0 and -0 share a code
        assert set(steps.tolist()) == {0, 1}
        assert int((steps == 0).sum()) == 1


def test_nudge_matches_nextafter():
    values = all_bf16()
    finite = values.float().isfinite() & (values.float() != 0)
    values = values[finite]
    inf = torch.full_like(values, float("inf"))
    # compared as values: one step up from the negative smallest subnormal is +0 here, -0 in torch
    assert torch.equal(nudge_bf16(values, 1).float(), torch.nextafter(values, inf).float())
    assert torch.equal(nudge_bf16(values, -1).float(), torch.nextafter(values, -inf).float())


def test_subnormal_masks():
    bf16 = all_bf16()
    smallest_normal = torch.finfo(torch.bfloat16).tiny
    assert torch.equal(subnormal(bf16), (bf16.float().abs() < smallest_normal) & (bf16.float() != 0))
    fp8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(subnormal(fp8), (fp8.float().abs() < 2.0**-6) & (fp8.float() != 0))


def test_step_distance():
    a = torch.tensor([1.0, 1.0, float("nan"), float("nan"), -0.0, 2.0]).bfloat16()
    b = torch.tensor([1.0, 1.0078125, float("nan"), 3.0, 0.0, -2.0]).bfloat16()
    dist = step_distance(a, b)
    assert dist[:5].tolist() == [0, 1, 0, NAN_MISMATCH, 0]
    assert int(dist[5]) == 2 * int(ordered_codes(b[5:])[0].abs())
