"""Collectives of QuantizedTensors: each tensor's payload and scales travel as bytes in ONE collective (all-gather
along rows, and the uneven all-to-all a token dispatch needs), charged at their true byte size."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle, PendingCollective
from megafp8_kernels import QuantizedTensor, wire_bytes
from megafp8_kernels.formats import WHOLE


def _one_scale(x: QuantizedTensor) -> bool:
    return x.layout.block == (WHOLE, WHOLE)


def all_gather_rows_async(x: QuantizedTensor, handle: GroupHandle, kind: str) -> PendingCollective:
    """Concatenate every member's row-major copy along rows; wait() gives the gathered QuantizedTensor.

    One scale per tensor: every member quantized with the same scale (delayed: synchronized; current: agreed amax),
    so only the payload travels. Row and block scales differ by member: payload and scales travel together.
    A two-level tensor's global scale must agree too (it is per tensor): it is kept, not gathered."""
    data, scale_inv = x.row_major()
    rows, cols = x.shape
    shape = (rows * handle.size, cols)
    if _one_scale(x):
        gathered = torch.empty((data.shape[0] * handle.size, *data.shape[1:]), dtype=data.dtype, device=data.device)
        pending = C.all_gather_into_tensor_async(gathered, data, handle, kind)
        return PendingCollective(pending, finish=lambda p: QuantizedTensor(
            shape, x.format, x.layout, p.wait(), scale_inv, global_scale_inv=x.global_scale_inv))
    pending = C.all_gather_quantized_async(data, scale_inv, handle, kind)
    return PendingCollective(pending, finish=lambda p: QuantizedTensor(
        shape, x.format, x.layout, *p.wait(), global_scale_inv=x.global_scale_inv))


def all_to_all_rows_async(x: QuantizedTensor, input_splits: list[int], output_splits: list[int],
                          handle: GroupHandle, kind: str) -> PendingCollective:
    """Uneven all-to-all of rows (a token dispatch): rows [sum(input_splits[:i]), +input_splits[i]) go to member i,
    and output_splits[j] rows come from member j; wait() gives the received rows as a QuantizedTensor.

    Each row travels with its own scales, packed behind its payload bytes (one collective): layouts whose scales
    follow the rows (1 x K-block, rowwise) or one agreed scale per tensor (only the payload travels)."""
    data, scale_inv = x.row_major()
    if sum(input_splits) != x.shape[0] or len(input_splits) != handle.size or len(output_splits) != handle.size:
        raise ValueError(f"all_to_all_rows: splits {input_splits} -> {output_splits} do not cover {x.shape[0]} rows "
                         f"over {handle.size} members")
    if not _one_scale(x) and x.layout.block[0] != 1:
        raise ValueError(f"all_to_all_rows: scale layout {x.layout.name} groups several rows; only row-wise "
                         "groups (or one scale) can travel with their rows")
    rows_out = sum(output_splits)
    payload = wire_bytes(data).reshape(data.shape[0], -1)
    scale_bytes = None if _one_scale(x) else scale_inv.contiguous().view(torch.uint8).reshape(data.shape[0], -1)
    packed = payload if scale_bytes is None else torch.cat([payload, scale_bytes], dim=1)
    row_bytes = packed.shape[1]
    received = torch.empty((rows_out, row_bytes), dtype=torch.uint8, device=packed.device)

    def unpack(flat: torch.Tensor) -> QuantizedTensor:
        out_data = flat[:, :payload.shape[1]].contiguous().view(data.dtype).reshape(rows_out, *data.shape[1:])
        if scale_bytes is None:
            return QuantizedTensor((rows_out, x.shape[1]), x.format, x.layout, out_data, scale_inv,
                                   global_scale_inv=x.global_scale_inv)
        scales = flat[:, payload.shape[1]:].contiguous().view(scale_inv.dtype).reshape(rows_out, -1)
        if x.layout.k_block_major:  # the canonical memory order, as the quantizer returns it (scaling.to_scale_layout)
            scales = torch.empty(scales.shape[::-1], dtype=scales.dtype, device=scales.device).t().copy_(scales)
        return QuantizedTensor((rows_out, x.shape[1]), x.format, x.layout, out_data, scales,
                               global_scale_inv=x.global_scale_inv)

    if handle.size == 1:
        return PendingCollective(received.copy_(packed), finish=unpack)
    sent = sum(n for member, n in enumerate(input_splits) if member != handle.rank)
    handle.counters.add(kind, sent * row_bytes, handle.ranks)
    work = dist.all_to_all_single(received, packed.contiguous(), output_split_sizes=output_splits,
                                  input_split_sizes=input_splits, group=handle.group, async_op=True)
    return PendingCollective(received, work, finish=unpack, counters=handle.counters)
