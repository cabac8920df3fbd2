"""Qwen-Image 2.1: the single-stream DiT family (config, token layout and KV cache, transformer, loading,
quantization description). See README.md in this package for what the pipeline must do."""
