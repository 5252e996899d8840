"""Low-precision glue for tensor/sequence parallelism: sequence all-gathers of quantized operands (payload bytes +
scales over the TP group) and the once-per-step amax reduction over the TP x DP group."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megafp8.fp8 import Float8Tensor, Fp8ScalingManager
from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.quantized_collectives import all_gather_rows_async


class TensorParallelSequenceComm:
    """megafp8.fp8.SequenceParallelComm over a TP group. Rows are [s, b]-flattened tokens, so dim 0
    is the sequence and a row all-gather is the sequence all-gather. Every method but sync_amax returns
    a collective in flight (wait() gives the result), so the FP8 op can overlap it with a GEMM."""

    def __init__(self, tp: GroupHandle):
        self.tp = tp

    @property
    def size(self) -> int:
        return self.tp.size

    @property
    def rank(self) -> int:
        return self.tp.rank

    def sync_amax(self, amax: torch.Tensor) -> None:
        C.all_reduce(amax, self.tp, "amax_reduce", op=dist.ReduceOp.MAX)

    def gather_rows_async(self, x: Float8Tensor) -> C.PendingCollective:
        # Payload and scales in one collective (only the payload when every rank shares one scale).
        return all_gather_rows_async(x, self.tp, "tp_sp_allgather")

    def gather_cols_async(self, data_t: torch.Tensor) -> C.PendingCollective:
        cols, rows = data_t.shape
        n = self.tp.size
        gathered = torch.empty((n * cols, rows), dtype=data_t.dtype, device=data_t.device)
        pending = C.all_gather_into_tensor_async(gathered, data_t, self.tp, "tp_sp_allgather")
        # Each rank sent its (cols, rows) block; place them side by side: (cols, n * rows). One byte per element.
        return C.PendingCollective(pending, finish=lambda p: (
            p.wait().view(n, cols, rows).permute(1, 0, 2).reshape(cols, n * rows) if n > 1 else p.wait()))

    def reduce_scatter_rows_async(self, t: torch.Tensor) -> C.PendingCollective:
        output = torch.empty((t.shape[0] // self.tp.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return C.reduce_scatter_tensor_async(output, t, self.tp, "tp_reduce_scatter")

    def all_reduce_async(self, t: torch.Tensor) -> C.PendingCollective:
        return C.all_reduce_async(t, self.tp, "tp_allreduce")


def fp8_scaling_manager(model: nn.Module, parallel_state: ParallelState) -> Fp8ScalingManager:
    """The delayed-scaling manager of `model` (this process's pipeline stage), reducing amaxes over the
    stage's TP x DP group (ParallelState.amax_group, never WORLD) in one counted collective."""

    def all_reduce_max(tensor: torch.Tensor, group: GroupHandle) -> None:
        C.all_reduce(tensor, group, "amax_reduce", op=dist.ReduceOp.MAX)

    return Fp8ScalingManager(model, parallel_state.amax_group, all_reduce_max=all_reduce_max,
                             expert_group=parallel_state.group("expert_amax"))
