"""FP8 gradient reduce-scatter (``--fp8-grad-reduce``): a bucket's grads summed over DP as FP8 bytes sent by an
all-to-all and added locally in fp32, giving each rank its fp32 shard exactly where a reduce-scatter puts it.

Each bucket is cut into ``DP`` pieces, piece ``j`` (elements ``[j S, (j+1) S)``) being the shard rank ``j``
owns. Every parameter's part of every piece (a *segment*; 128-element groups never straddle two, so a
table of one segment id per group describes them) gets one scale, agreed over DP: one MAX all-reduce of the
segment amaxes (``4 DP P`` bytes for ``P`` parameters: one scale per piece instead would let a layer with
small grads underflow next to one with large grads), in which a NaN/inf anywhere travels as an infinite amax, so every rank learns of it from
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


GROUP = 128  # elements; the grad buffer's alignment: a segment is a whole number of groups
# Elements cast per slab: the cast's fp32 temporaries are bounded by a slab, not the bucket (a 40M-element bucket
# held ~8 B per element of them at once before); the received pieces are summed one at a time for the same reason.
CAST_SLAB = 1 << 22


def segment_amax(grad: torch.Tensor, segment_of_group: torch.Tensor, num_segments: int) -> torch.Tensor:
    """fp32 max |g| of each segment of the flat ``grad``; a NaN makes its segment's amax inf (a MAX all-reduce
    then carries it to every rank; NaN would not survive every backend's MAX)."""
    group_amax = torch.nan_to_num(grad.view(-1, GROUP).abs().amax(dim=1).float(), nan=float("inf"))
    return group_amax.new_zeros(num_segments).scatter_reduce_(0, segment_of_group, group_amax, "amax")


def segments_by_piece(grad_numel: int, dp_size: int, device=None) -> tuple[torch.Tensor, int]:
    """One segment per piece (the whole piece shares a scale): ``(segment_of_group, num_segments)``."""
    groups = torch.arange(grad_numel // GROUP, device=device)
    return groups // (grad_numel // GROUP // dp_size), dp_size


def fp8_reduce_scatter_async(grad: torch.Tensor, handle: GroupHandle, kind: str = "dp_grad_reduce",
                             fp8_dtype: torch.dtype = GRAD_REDUCE_DTYPE,
                             segments: tuple[torch.Tensor, int] | None = None) -> PendingCollective:
    """Sum the flat ``grad`` (same length on every member, a multiple of ``GROUP x`` the group size) over the
    group through FP8, one agreed scale per segment (``segments``: the segment id of each 128-element group,
    segments inside one piece; default one per piece); ``wait()`` returns this member's fp32 shard
    ``[r S, (r+1) S)`` of the sum (all NaN when any member's grad held a NaN/inf). The amax all-reduce runs
    now (small, blocking); the all-to-all stays in flight."""
    n, fmt = handle.size, fp8_format(fp8_dtype)
    segment_of_group, num_segments = segments or segments_by_piece(grad.numel(), n, grad.device)
    amax = C.all_reduce(segment_amax(grad, segment_of_group, num_segments), handle, kind, op=dist.ReduceOp.MAX)
    finite = torch.isfinite(amax).all()
    scale = scale_from_amax(amax, fmt.max, power_of_2_scale=False)[segment_of_group]  # per group
    rows, slab_rows = grad.view(-1, GROUP), CAST_SLAB // GROUP
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=grad.device)
    for start in range(0, rows.shape[0], slab_rows):
        part = slice(start, start + slab_rows)
        codes[part] = saturating_cast(rows[part].float() * scale[part, None], fmt).view(torch.uint8)
    codes = codes.view(-1)
    received = torch.empty_like(codes)
    pending = C.all_to_all_single_async(received, codes, handle, kind)
    scale_inv = reciprocal(scale.view(n, -1)[handle.rank])  # my piece's groups: the same on every sender

    def local_sum(pieces: torch.Tensor) -> torch.Tensor:
        pieces = pieces.view(n, -1, GROUP).view(fp8_dtype)
        total = pieces[0].float()
        for sender in range(1, n):  # in rank order, one decoded piece at a time
            total += pieces[sender].float()
        total *= scale_inv[:, None]
        return torch.where(finite, total, torch.full_like(total, float("nan"))).view(-1)

    return PendingCollective(pending, finish=lambda p: local_sum(p.wait()))
