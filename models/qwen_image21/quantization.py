"""What the shared FP8 quantize code needs to know about Qwen-Image 2.1 (DESIGN §3, §4.1).

- `BF16_FALLBACK`: module globs kept in BF16. Outside the blocks everything runs once per step on few rows
  (`img_in`, `txt_in.*`, `time_text_embed.*`, the shared `modulation.1`, `norm_out.linear`, `proj_out`), as
  in Qwen-Image's list. Inside the blocks `img_mlp.out` stays BF16 by analogy with Qwen-Image's
  `img_mlp.net.2` (the MLP down projection, whose naive FP8 gives dark, blurry images there; SwiGLU
  products carry larger outliers than GELU's): not measured for 2.1. `ALL_BLOCKS_FP8` quantizes it too,
  which turns on the SwiGLU+quant producer.
- `SHARED_INPUT_GROUPS`: linears that read one activation and so must share one input scale for the fused
  producer to write their FP8 input once: Q/K/V (producer a) and the MLP's gate_layer/proj (producer b).
- `share_input_amax`: the calibration amax made equal within each group (pipelines/quantize.py's
  `share_group_amax` hard-codes Qwen-Image's groups, and models may not import pipelines).
"""

import torch

BF16_FALLBACK = (
    "img_in",
    "txt_in.*",
    "time_text_embed.*",
    "modulation.1",
    "norm_out.linear",
    "proj_out",
    "*.img_mlp.out",
)
ALL_BLOCKS_FP8 = tuple(p for p in BF16_FALLBACK if p != "*.img_mlp.out")
SHARED_INPUT_GROUPS = (("to_q", "to_k", "to_v"), ("gate_layer", "proj"))


def share_input_amax(
    amax: dict[str, torch.Tensor], groups: tuple[tuple[str, ...], ...] = SHARED_INPUT_GROUPS
) -> dict[str, torch.Tensor]:
    """`amax` by module name with every member of a complete group (same parent module) set to the group's
    max; other entries unchanged. Device tensors in, device tensors out (no host syncs)."""
    shared = dict(amax)
    for name in amax:
        parent, _, leaf = name.rpartition(".")
        for group in groups:
            members = [f"{parent}.{m}" if parent else m for m in group]
            if leaf in group and all(m in amax for m in members):
                shared[name] = torch.stack([amax[m] for m in members]).max()
    return shared
