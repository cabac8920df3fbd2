"""The two numerics modes every producer follows (torch-free, so variant tables can name them).

`reference`: diffusers' arithmetic op for op. `contract`: the DESIGN §4 rounding contract (Triton on CUDA,
the torch twins elsewhere), which the fused FP8 producers also follow.
"""

from enum import StrEnum


class Numerics(StrEnum):
    REFERENCE = "reference"
    CONTRACT = "contract"
