"""Qwen-Image's prompt template (DESIGN §2); torch-free, so argument checks
can import it before any model loads."""

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP_TOKENS = 34  # the system part and "<|im_start|>user\n"
