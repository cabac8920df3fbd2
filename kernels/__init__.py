"""Fused FP8 producer kernels (Triton) with their torch reference twins; see DESIGN §4.

Each fused op is one `FusedOp` (kernels/_triton_common.py) in its module: called, it runs the Triton kernel on
CUDA when its guard accepts the input, else its torch twin (always on a CPU); `<op>_torch` is the twin and
`<op>_triton` the kernel alone (None where the guard rejects). The models reach them through
`kernels.seam`; `kernels.numerics` stays importable without torch.
"""
