"""--check-for-nan-in-loss-and-grad and --check-for-spiky-loss, judged on the device: a step's verdict without a
host sync, reaching the host one step later (or at the next iteration that reads the device anyway).

Per step, every rank: one 2-float MAX all-reduce over the world of (this rank's loss is non-finite, its |loss|):
the last pipeline stage's ranks hold a loss, the others send zeros. With the global grad norm (already the same
on every rank) that gives each rank the same verdict:
    non-finite: some rank's loss, or the grad norm, is NaN/inf (under --fp16 the loss only: an overflowing grad
        is the loss scaler's business);
    spike: the largest |loss| >= --spiky-loss-factor x the reference, the largest |loss| of the first
        --spiky-loss-samples steps that were not suspicious (Megatron-LM's is_unexpectedly_large: 10 x the max
        of the first 100); no spike is judged before the reference is complete. Saved in checkpoints.
The verdict is copied to host memory without blocking; ``LaggedVerdicts`` hands it to the host later.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Verdict:
    """One step's verdict (device tensors, the same on every rank except ``local_loss``)."""

    suspicious: torch.Tensor   # bool: the checks asked for a look (a re-run under validate_results)
    nonfinite: torch.Tensor    # bool: a non-finite loss or grad norm
    loss_nonfinite: torch.Tensor  # bool: some rank's loss is non-finite
    spike: torch.Tensor        # bool: the spike rule fired
    loss_max: torch.Tensor     # fp32: the largest finite |loss| of any rank
    grad_norm: torch.Tensor    # fp64: the global grad norm
    local_loss: torch.Tensor   # fp32: this rank's loss (0 off the last pipeline stage)

    def kind(self) -> str:
        return "nan" if bool(self.nonfinite) else "spike" if bool(self.spike) else "none"


class ResultChecks:
    """The device-side checks of one rank (module docstring)."""

    def __init__(self, check_nan: bool, check_spike: bool, factor: float, samples: int, fp16: bool,
                 device: torch.device) -> None:
        self.check_nan, self.check_spike, self.factor, self.samples, self.fp16 = (check_nan, check_spike, factor,
                                                                                 samples, fp16)
        self.reference = torch.zeros((), dtype=torch.float32, device=device)  # the spike rule's reference |loss|
        self.seen = torch.zeros((), dtype=torch.int64, device=device)         # steps that went into it
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1

    def judge(self, local_loss: torch.Tensor, grad_norm: torch.Tensor, update_reference: bool = True) -> Verdict:
        """This step's verdict from this rank's loss and the global grad norm (no host sync)."""
        local = local_loss.detach().float().reshape(())
        finite = torch.isfinite(local)
        packed = torch.stack([(~finite).float(), torch.where(finite, local.abs(), 0.0)]).to(self.reference.device)
        if self.distributed:  # logging-sized, like the logged loss's mean: not byte-counted
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        nonfinite = packed[0] > 0
        if not self.fp16:
            nonfinite = nonfinite | ~torch.isfinite(grad_norm.to(packed.device))
        loss_max = packed[1]
        ready = self.seen >= self.samples
        spike = ready & (loss_max >= self.factor * self.reference) if self.check_spike else torch.zeros_like(ready)
        suspicious = (nonfinite if self.check_nan else torch.zeros_like(ready)) | spike
        if self.check_spike and update_reference:
            grows = ~ready & ~nonfinite
            self.reference.copy_(torch.where(grows, torch.maximum(self.reference, loss_max), self.reference))
            self.seen.add_(grows.long())
        return Verdict(suspicious, nonfinite, packed[0] > 0, spike, loss_max, grad_norm.to(packed.device), local)

    def device_state(self) -> dict[str, torch.Tensor]:
        """The spike reference as the device holds it (a step re-run restores it; checkpoints save it)."""
        return {"reference": self.reference, "seen": self.seen}

    def state_dict(self) -> dict[str, float]:
        return {"reference": float(self.reference), "seen": int(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.reference.fill_(float(state.get("reference", 0.0)))
        self.seen.fill_(int(state.get("seen", 0)))

    def describe_rule(self) -> str:
        return (f"loss >= {self.factor:g} x the largest |loss| of the first {self.samples} steps "
                f"(reference {float(self.reference):.6g} after {int(self.seen)} steps)")


class HostFlag:
    """A device bool copied to (pinned) host memory without blocking; ``read`` waits for that copy only."""

    def __init__(self, flag: torch.Tensor) -> None:
        cuda = flag.device.type == "cuda"
        self.host = torch.empty((), dtype=torch.bool, pin_memory=cuda)
        self.host.copy_(flag, non_blocking=cuda)
        self.event = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()

    def read(self) -> bool:
        if self.event is not None:
            self.event.synchronize()  # the copy of an earlier step: done unless the host ran that far ahead
        # A plain read of host memory (no torch op, so nothing that could wait for the device).
        return ctypes.c_bool.from_address(self.host.data_ptr()).value
