"""Counts, per training iteration, what makes a GPU host wait or copy: device->host reads (`aten::_local_scalar_dense`
from .item()/float(t)/bool(t), Tensor.tolist()/.cpu()/.numpy()) and host->device copies (`aten::lift_fresh`:
torch.tensor(python data, device=...), a blocking copy on a GPU). Used by the host-sync tests in this process, in
each gloo rank, and under torchrun (host_sync_probe.py)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megafp8.training.megatron_flags import LLAMA_FLAGS

MODEL = [*LLAMA_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--train-iters", "4",
         "--log-interval", "4", "--eval-iters", "0", "--use-distributed-optimizer", "--clip-grad", "1.0"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
       "--fp8-amax-compute-algo", "max"]


class HostReads(TorchDispatchMode):
    """``reads[iteration]``: what each iteration read from or copied to the device (``iteration`` set by the
    patched train_step; 0 is set-up)."""

    def __init__(self):
        super().__init__()
        self.iteration, self.reads, self.host_side = 0, {}, False

    def count(self, what: str) -> None:
        if not self.host_side:
            self.reads.setdefault(self.iteration, []).append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count("_local_scalar_dense")
        elif func is torch.ops.aten.lift_fresh.default:
            self.count("host_to_device")
        return func(*args, **(kwargs or {}))

    def _host_side_batches(self, make_batches):
        """The data loader builds each batch in host memory (torch.from_numpy: a lift, but no device copy), which
        the trainer then sends with one non-blocking pinned copy: what the loader does is not counted."""
        def counted_apart(*args, **kwargs):
            source = make_batches(*args, **kwargs)
            while True:
                self.host_side = True
                try:
                    batch = next(source)
                except StopIteration:
                    return
                finally:
                    self.host_side = False
                yield batch
        return counted_apart

    def install(self):
        """Patch the trainer and the Tensor read methods to count into this object; returns the undo."""
        from megafp8.training import train as train_module

        originals = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in ("tolist", "cpu", "numpy")]
        originals += [(train_module.Trainer, "train_step", train_module.Trainer.train_step),
                      (train_module, "batches", train_module.batches)]
        original_step = train_module.Trainer.train_step

        def train_step(trainer):
            self.iteration = trainer.progress.iteration + 1
            return original_step(trainer)

        for owner, name, method in originals[:3]:
            setattr(owner, name, lambda tensor, *a, _m=method, _n=name, **k: (self.count(_n), _m(tensor, *a, **k))[1])
        train_module.Trainer.train_step = train_step
        train_module.batches = self._host_side_batches(train_module.batches)

        def undo():
            for owner, name, method in originals:
                setattr(owner, name, method)
        return undo

    def assert_quiet_between_logs(self) -> None:
        """Iterations 2 and 3 of 4 (logging every 4) neither read the device nor copy to it."""
        assert self.reads.get(2, []) == [] and self.reads.get(3, []) == [], self.reads
