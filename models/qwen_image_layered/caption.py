"""Diffusers' captioning of an image by Qwen-Image-Layered's vision-language model, for a request whose
prompt is empty: its two instruction prompts (English and Chinese, the checkpoint's data, kept exactly as
`QwenImageLayeredPipeline` sets them; a test compares them) and the generation it runs."""

import PIL.Image
import torch

CAPTION_PROMPT_EN = (
    "<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n"
    "# Image Annotator\n"
    "You are a professional\n"
    "image annotator. Please write an image caption based on the input image:\n"
    "1. Write the caption using natural,\n"
    "descriptive language without structured formats or rich text.\n"
    "2. Enrich caption details by including: \n"
    " - Object\n"
    "attributes, such as quantity, color, shape, size, material, state, position, actions, and so "
    "on\n"
    " - Vision Relations\n"
    "between objects, such as spatial relations, functional relations, possessive relations, "
    "attachment relations, action\n"
    "relations, comparative relations, causal relations, and so on\n"
    " - Environmental details, such as weather, lighting,\n"
    "colors, textures, atmosphere, and so on\n"
    " - Identify the text clearly visible in the image, without translation or\n"
    "explanation, and highlight it in the caption with quotation marks\n"
    "3. Maintain authenticity and accuracy:\n"
    " - Avoid\n"
    "generalizations\n"
    " - Describe all visible information in the image, while do not add information not explicitly "
    "shown in\n"
    "the image\n"
    "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
    "<|im_start|>assistant\n"
)

CAPTION_PROMPT_CN = (
    "<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n"
    "# 图像标注器\n"
    "你是一个专业的图像标注器。请基于输入图像，撰写图注:\n"
    "1.\n"
    "使用自然、描述性的语言撰写图注，不要使用结构化形式或富文本形式。\n"
    "2. 通过加入以下内容，丰富图注细节：\n"
    " - 对象的属性：如数量、颜色、形状、大小、位置、材质、状态、动作等\n"
    " -\n"
    "对象间的视觉关系：如空间关系、功能关系、动作关系、从属关系、比较关系、因果关系等\n"
    " - 环境细节：例如天气、光照、颜色、纹理、气氛等\n"
    " - 文字内容：识别图像中清晰可见的文字，不做翻译和解释，用引号在图注中强调\n"
    "3.\n"
    "保持真实性与准确性：\n"
    " - 不要使用笼统的描述\n"
    " -\n"
    "描述图像中所有可见的信息，但不要加入没有在图像中出现的内容\n"
    "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
    "<|im_start|>assistant\n"
)

MAX_CAPTION_TOKENS = 512  # diffusers' `max_new_tokens`


@torch.no_grad()
def caption_image(
    text_encoder: torch.nn.Module, processor, image: PIL.Image.Image, english: bool, device: torch.device
) -> str:
    """The model's caption of `image` (diffusers' `get_image_caption`: its instruction with the image, the
    text encoder's own generation settings, up to 512 new tokens, special tokens dropped, stripped)."""
    prompt = CAPTION_PROMPT_EN if english else CAPTION_PROMPT_CN
    inputs = processor(text=prompt, images=image, padding=True, return_tensors="pt").to(device)
    generated = text_encoder.generate(**inputs, max_new_tokens=MAX_CAPTION_TOKENS)
    new = [out[len(given) :] for given, out in zip(inputs.input_ids, generated, strict=True)]
    text = processor.batch_decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)[0]
    return text.strip()
