"""The Qwen-Image-Edit family (Edit, Edit-2509, Edit-2511): the Qwen-Image DiT editing reference images."""
