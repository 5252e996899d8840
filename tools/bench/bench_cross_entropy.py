"""fp32 bytes of the vocab-parallel cross-entropy on bf16 logits: the largest fp32 tensor any op makes during
forward + backward (a TorchDispatchMode watching every output), and the bytes autograd saves for backward
besides the logits themselves.

    python tools/bench/bench_cross_entropy.py --tokens 1024 --vocab 128256

One process (TP=1, the worst case: the whole vocab on one rank), CPU; byte counts do not depend on the device.
Run from a checkout's root (it imports that checkout's megafp8), so two commits compare by running it in each.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.getcwd())  # run from the checkout's root


class LargestFloat32Output(TorchDispatchMode):
    """The largest fp32 tensor any op returns (views included: a view of a big fp32 tensor is one too);
    tests/test_cross_entropy.py bounds it too."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel() * 4)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()

    from megafp8.parallel.collectives import GroupHandle
    from megafp8.parallel.cross_entropy import vocab_parallel_cross_entropy

    logits = torch.randn(args.tokens, args.vocab).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,))
    saved: dict[int, int] = {}  # storage -> bytes, a storage saved twice counted once

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() != logits.untyped_storage().data_ptr():  # the logits exist anyway (the head made them)
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with LargestFloat32Output() as watch:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = vocab_parallel_cross_entropy(logits, target, GroupHandle.solo())
        loss.sum().backward()
    mib = 2 ** 20
    print(f"| {args.tokens} x {args.vocab} bf16 | {logits.numel() * 2 / mib:,.0f} MiB | "
          f"{watch.largest / mib:,.1f} MiB | {sum(saved.values()) / mib:,.2f} MiB |")


if __name__ == "__main__":
    main()
