"""The Qwen-Image family: the 20B MMDiT text-to-image model (DESIGN §1-2), its components and hooks."""
