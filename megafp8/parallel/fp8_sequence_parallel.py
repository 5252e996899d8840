"""FP8 glue for tensor/sequence parallelism: sequence all-gathers of FP8 operands (uint8 bytes + scales
over the TP group) and the once-per-step amax reduction over the TP x DP group."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megafp8.fp8 import Float8Tensor, Fp8ScalingManager
from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle
from megafp8.parallel.parallel_state import ParallelState
from megafp8_kernels import Granularity


class TensorParallelSequenceComm:
    """megafp8.fp8.SequenceParallelComm over a TP group. Rows are [s, b]-flattened tokens, so dim 0
    is the sequence and a row all-gather is the sequence all-gather."""

    def __init__(self, tp: GroupHandle):
        self.tp = tp

    def sync_amax(self, amax: torch.Tensor) -> None:
        C.all_reduce(amax, self.tp, "amax_reduce", op=dist.ReduceOp.MAX)

    def gather_rows(self, x: Float8Tensor) -> Float8Tensor:
        if x.granularity is Granularity.TENSORWISE:
            # Every rank quantized with the same scale (delayed: synchronized; current: sync_amax),
            # so only the bytes travel.
            data, scales = C.all_gather(x.data, self.tp, "tp_sp_allgather", dim=0), x.scale_inv
        else:
            data, scales = C.all_gather_quantized(x.data, x.scale_inv, self.tp, "tp_sp_allgather")
        rows, cols = x.shape
        return Float8Tensor((rows * self.tp.size, cols), x.fp8_dtype, x.granularity, data, scales)

    def reduce_scatter_rows(self, t: torch.Tensor) -> torch.Tensor:
        return C.reduce_scatter(t, self.tp, "tp_reduce_scatter", dim=0)


def fp8_scaling_manager(model: nn.Module, parallel_state: ParallelState) -> Fp8ScalingManager:
    """The delayed-scaling manager of `model` (this process's pipeline stage), reducing amaxes over the
    stage's TP x DP group (ParallelState.amax_group, never WORLD) in one counted collective."""

    def all_reduce_max(tensor: torch.Tensor, group: GroupHandle) -> None:
        C.all_reduce(tensor, group, "amax_reduce", op=dist.ReduceOp.MAX)

    return Fp8ScalingManager(model, parallel_state.amax_group, all_reduce_max=all_reduce_max)
