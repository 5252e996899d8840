"""Test session setup: on machines without CUDA, Triton kernels run in Triton's interpreter."""
import os

import torch

if not torch.cuda.is_available():
    # Must happen before megafp8_kernels is imported: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
