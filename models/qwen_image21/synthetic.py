"""Qwen-Image 2.1 components to fill with random weights, at toy or released sizes (tests, benchmarks): a
Qwen3-VL config, the Qwen3-VL processor with the real Qwen2 byte-level tokenizer and a chat template, and the
sizes of the released transformer (diffusers' defaults) and text encoder (Qwen3-VL-8B, as its config.json
gives them)."""

from typing import Any

from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLProcessor

from qwen_image_fusion.models.qwen_image.tokenizer import build_qwen2_tokenizer
from qwen_image_fusion.models.vl_processor import without_video

# Enough of Qwen3-VL's chat template for what the pipeline renders: messages of text and image parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 151936
QWEN3_VL_8B_TEXT = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                     "mrope_interleaved": True},
)  # fmt: skip
QWEN3_VL_8B_VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
    num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
)  # fmt: skip
TOY_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3],
                     "mrope_interleaved": True},
)  # fmt: skip
TOY_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
    num_position_embeddings=64, deepstack_visual_indexes=[0],
)  # fmt: skip
PATCHING = dict(patch_size=16, spatial_merge_size=2, temporal_patch_size=2)  # Qwen3-VL's
# Qwen3-VL's image processor: 16-pixel patches merged 2x2, pixels in [64K, 16M], mean and std 0.5
IMAGE_PROCESSOR: dict[str, Any] = dict(
    patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)  # fmt: skip


def text_encoder_config(text: dict[str, Any], vision: dict[str, Any]) -> Qwen3VLConfig:
    """A Qwen3-VL config with the real vocabulary and Qwen3-VL's patching, at the sizes given."""
    return Qwen3VLConfig(
        text_config={"vocab_size": VOCAB_SIZE, **text},
        vision_config={**PATCHING, **vision},
        tie_word_embeddings=False,
    )


def processor(min_pixels: int = IMAGE_PROCESSOR["size"]["shortest_edge"]) -> Qwen3VLProcessor:
    """Qwen3-VL's processor (PIL image backend, no video processor) with the real Qwen2 tokenizer and
    `CHAT_TEMPLATE`; `min_pixels` lower than Qwen3-VL's lets toy images through unresized."""
    settings = IMAGE_PROCESSOR | {"size": IMAGE_PROCESSOR["size"] | {"shortest_edge": min_pixels}}
    return without_video(Qwen3VLProcessor)(
        image_processor=Qwen2VLImageProcessorPil(**settings),
        tokenizer=build_qwen2_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )
