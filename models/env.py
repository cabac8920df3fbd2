"""Switches read from the environment (torch-free)."""

import os


def env_flag(name: str) -> bool:
    """An on-by-default switch from the environment: `0`, `off`, `false` or `no` turn it off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "false", "no")
