"""A TorchDispatchMode that counts the aten ops a region dispatches and its host reads (_local_scalar_dense)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.host_reads = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.host_reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))
