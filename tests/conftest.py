"""Test-wide setup: Triton runs under its CPU interpreter when there is no GPU; `gpu` tests skip cleanly."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any kernel module is imported: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
