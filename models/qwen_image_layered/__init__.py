"""Qwen-Image-Layered: an image decomposed into RGBA layers (diffusers' `QwenImageLayeredPipeline`)."""
