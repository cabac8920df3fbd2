"""How the shared FP8 quantize code treats Qwen-Image 2.1 (DESIGN §3, §4.1).

BF16 fallback: outside the blocks everything runs once per step on few rows (`img_in`, `txt_in.*`,
`time_text_embed.*`, the shared `modulation.1`, `norm_out.linear`, `proj_out`), as in Qwen-Image's list.
Inside the blocks `img_mlp.out` stays BF16 by analogy with Qwen-Image's `img_mlp.net.2` (the MLP down
projection, whose naive FP8 gives dark, blurry images there; SwiGLU products carry larger outliers than
GELU's): not measured for 2.1. The all-blocks list quantizes it too, which turns on the SwiGLU+quant
producer. Shared inputs: Q/K/V (producer a) and the MLP's gate_layer/proj (producer b) read one activation,
so each group shares one input scale for the fused producer to write their FP8 input once.
"""

from qwen_image_fusion.models.family import QuantRecipe

OUTSIDE_BLOCKS = ("img_in", "txt_in.*", "time_text_embed.*", "modulation.1", "norm_out.linear", "proj_out")
QUANTIZATION = QuantRecipe(
    bf16_fallback=(*OUTSIDE_BLOCKS, "*.img_mlp.out"),
    shared_inputs=(("to_q", "to_k", "to_v"), ("gate_layer", "proj")),
    all_blocks_fp8=OUTSIDE_BLOCKS,
    outside_blocks=OUTSIDE_BLOCKS,
)
