"""FP8 gradient reduce-scatter (``--fp8-grad-reduce``): a bucket's grads summed over DP as FP8 bytes sent by an
all-to-all and added locally in fp32, giving each rank its fp32 shard exactly where a reduce-scatter puts it.

Each bucket is cut into ``DP`` pieces, piece ``j`` (elements ``[j S, (j+1) S)``) being the shard rank ``j``
owns. Every piece gets one scale, agreed over DP: one MAX all-reduce of the ``DP`` local piece amaxes
(``4 DP`` bytes), in which a NaN/inf anywhere travels as an infinite amax, so every rank learns of it from
the same collective and returns an all-NaN shard (the optimizer's non-finite norm then skips the step on
every rank). The grads are cast to FP8 under the agreed scale (``saturating_cast(g * scale)``: the scale
maps the piece's amax to the format's max, so nothing saturates), piece ``j`` is sent to rank ``j`` (an
all-to-all, one byte per element), and the receiver decodes the ``DP`` pieces it got and sums them in fp32
in rank order (deterministic; no addition ever happens in FP8, unlike a ring reduction in FP8).

Format: E4M3 by default. On real gradients of the tiny GPT (tests/test_fp8_grad_reduce.py measures it on
every run) E4M3's extra mantissa bit is worth ~6 dB of SQNR, while E5M2's wider range only helps the
smallest elements, whose error hardly counts in the SQNR (the per-piece scale puts the largest at 448).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle, PendingCollective
from megafp8_kernels import fp8_format
from megafp8_kernels.quantize_reference import reciprocal, saturating_cast, scale_from_amax

GRAD_REDUCE_DTYPE = torch.float8_e4m3fn


def piece_amax(grad: torch.Tensor, dp_size: int) -> torch.Tensor:
    """fp32 max |g| of each of the ``dp_size`` pieces of the flat ``grad``; a NaN makes its piece's amax inf
    (a MAX all-reduce then carries it to every rank; NaN would not survive every backend's MAX)."""
    amax = grad.view(dp_size, -1).abs().amax(dim=1).float()
    return torch.nan_to_num(amax, nan=float("inf"))


def fp8_reduce_scatter_async(grad: torch.Tensor, handle: GroupHandle, kind: str = "dp_grad_reduce",
                             fp8_dtype: torch.dtype = GRAD_REDUCE_DTYPE) -> PendingCollective:
    """Sum the flat ``grad`` (same length on every member, a multiple of the group size) over the group through
    FP8; ``wait()`` returns this member's fp32 shard ``[r S, (r+1) S)`` of the sum (all NaN when any member's
    grad held a NaN/inf). The amax all-reduce runs now (small, blocking); the all-to-all stays in flight."""
    n, fmt = handle.size, fp8_format(fp8_dtype)
    amax = C.all_reduce(piece_amax(grad, n), handle, kind, op=dist.ReduceOp.MAX)
    finite = torch.isfinite(amax).all()
    scale = scale_from_amax(amax, fmt.max, power_of_2_scale=False)
    codes = saturating_cast(grad.view(n, -1).float() * scale[:, None], fmt).view(torch.uint8).view(-1)
    received = torch.empty_like(codes)
    pending = C.all_to_all_single_async(received, codes, handle, kind)
    scale_inv = reciprocal(scale[handle.rank])

    def local_sum(pieces: torch.Tensor) -> torch.Tensor:
        total = pieces.view(n, -1).view(fp8_dtype).float().sum(dim=0) * scale_inv
        return torch.where(finite, total, torch.full_like(total, float("nan")))

    return PendingCollective(pending, finish=lambda p: local_sum(p.wait()))
