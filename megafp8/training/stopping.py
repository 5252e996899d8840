"""What stops a run on every rank together: SIGTERM/SIGINT, and the agreement of all ranks on a host-side fact."""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class StopSignal:
    """SIGTERM/SIGINT ask the loop to finish the current step, save and exit 0 (a scheduler's preemption)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def on_any_rank(value: bool) -> bool:
    """True on every rank if `value` is True on any (one MAX all-reduce over the world; the flag lives on the
    device the default group reduces: CUDA under NCCL). A one-process world (a plain run, or torchrun with one
    worker) has nothing to agree on: no collective, no device read."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = torch.cuda.current_device() if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([float(value)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
