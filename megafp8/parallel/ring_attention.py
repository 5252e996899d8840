"""Blockwise causal attention over context-parallel ranks (ring p2p or all-gather of K/V), merged by log-sum-exp.

Layout (Megatron-LM's load balancing for causal attention): the global sequence is cut into ``2N`` chunks
of ``c`` tokens; CP rank ``r`` holds chunks ``r`` and ``2N-1-r``, concatenated (``s_local = 2c``). For the
K/V of rank ``j`` seen by the queries of rank ``r`` there are three cases:

* ``j == r`` (diagonal): a plain causal mask over the ``2c`` local tokens is exactly the global causal mask
  (chunk ``r`` precedes chunk ``2N-1-r``);
* ``j < r``: both query chunks see K/V chunk ``j`` entirely and never chunk ``2N-1-j`` -> all queries x the
  first K/V half, no mask;
* ``j > r``: only query chunk ``2N-1-r`` sees anything, and it sees both K/V chunks -> the second query
  half x all K/V, no mask.

So every block but the diagonal is half the work of a full block and unmasked; the masked halves are never
computed. Each block runs through SDPA's fused flash kernel in the input dtype (``attention_blocks.attend``: its
output and log-sum-exp ``lse_i``, fp32), or with ``Fp8Blocks`` (--fp8-dot-product-attention) through the FP8
kernels on FP8 Q and K/V bytes (the ring then carries those bytes and their scales), and the blocks are merged in
fp32 (fp64 for fp64 inputs) as
``out = sum_i exp(lse_i - lse) out_i``. Backward hands each block the merged output and ``lse``
(``attention_blocks.attend_backward``: FlashAttention's renormalization), so nothing of size ``s x s`` is kept
across blocks: saved are q, k, v, the output and ``lse`` (``[b, heads, s_local]``, fp32).

Traffic, charged to ``cp_kv_p2p`` (``B_kv`` = bytes of this rank's K and V in their dtype, ``B_dkv`` = the
same shape in the compute dtype, fp32 for bf16/fp32 inputs):

* ``p2p`` forward: ``(N-1) B_kv`` sent per rank, each step's send/recv issued before that step's block is
  computed; backward: the K/V ring again, ``(N-1) B_kv``, plus the dK/dV accumulators travelling along the
  ring back to their owner, ``N B_dkv`` (a partial sum leaves every rank once per step).
* ``all_gather``: forward one all-gather, ``(N-1) B_kv`` (the diagonal block is computed while it is in
  flight); backward gathers K/V again, ``(N-1) B_kv``, and reduce-scatters dK/dV, ``(N-1) B_dkv``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8.parallel.attention_blocks import HighPrecisionBlocks, compute_dtype, merge
from megafp8.parallel.collectives import (CommCounters, GroupHandle, PendingCollective, all_gather_into_tensor_async,
                                          reduce_scatter_tensor)

_KIND = "cp_kv_p2p"
# gloo matches point-to-point messages by (peer, tag): K/V and dK/dV are in flight together in backward.
_KV_TAG, _DKV_TAG = 1, 2


def _blocks(cp_rank: int, src: int, chunk: int):
    """(query rows, key rows, causal) of the block between this rank's queries and rank ``src``'s K/V."""
    if src == cp_rank:
        return slice(None), slice(None), True
    if src < cp_rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, 2 * chunk), slice(None), False


class _Ring:
    """Send to the next CP rank, receive from the previous one (batch_isend_irecv), counted on send."""

    def __init__(self, handle: GroupHandle) -> None:
        n, r = handle.size, handle.rank
        self.handle = handle
        self.next, self.prev = handle.ranks[(r + 1) % n], handle.ranks[(r - 1) % n]

    def exchange(self, send: torch.Tensor, tag: int) -> "_InFlight":
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.handle.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.handle.group, tag)]
        self.handle.counters.add(_KIND, send.numel() * send.element_size(), self.handle.ranks)
        return _InFlight(recv, dist.batch_isend_irecv(ops), send)


class _InFlight:
    def __init__(self, recv: torch.Tensor, works, send: torch.Tensor) -> None:
        self._recv, self._works, self._send = recv, works, send  # keep `send` alive until it is on the wire

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._send = [], None
        return self._recv


def _forward(q, k, v, handle: GroupHandle, comm_type: str, scale: float, blocks):
    """Output ``[b, H, s, d]`` in the compute dtype, ``lse`` ``[b, H, s]``, and what backward keeps of the operands
    (``blocks``' queries and K/V message)."""
    n, r, ct = handle.size, handle.rank, compute_dtype(q.dtype)
    queries, kv = blocks.queries(q), blocks.pack_kv(k, v)
    saved = (*queries, kv)
    chunk = q.shape[2] // 2
    out = torch.zeros(q.shape, dtype=ct, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=ct, device=q.device)
    gathered = _gather_async(kv, handle) if comm_type == "all_gather" else None
    ring = _Ring(handle) if comm_type == "p2p" else None
    for step in range(n):
        src = (r - step) % n
        if gathered is not None and step == 1:
            all_kv = gathered.wait()
        if gathered is not None and step > 0:
            kv = all_kv[src]
        pending = ring.exchange(kv, _KV_TAG) if ring is not None and step < n - 1 else None
        rows, keys, causal = _blocks(r, src, chunk)
        block_out, block_lse = blocks.attend(queries, kv, rows, keys, causal, scale)
        merge(out[..., rows, :], lse[..., rows], block_out.to(ct), block_lse.to(ct))
        if pending is not None:
            kv = pending.wait()
    return out, lse, saved


def _gather_async(kv: torch.Tensor, handle: GroupHandle):
    # gloo wants the output as the dim-0 concatenation of the inputs: [N * 2, ...], viewed [N, 2, ...] after.
    all_kv = torch.empty((handle.size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    pending = all_gather_into_tensor_async(all_kv, kv, handle, _KIND)
    return PendingCollective(pending, finish=lambda p: p.wait().view(handle.size, *kv.shape))


def _backward(queries, kv, out, lse, dout, kv_shape, handle: GroupHandle, comm_type: str, scale: float, blocks):
    """(dq, dk, dv) in the compute dtype; ``kv_shape`` is one of K/V's ``[b, G, s, d]``."""
    n, r, ct = handle.size, handle.rank, lse.dtype
    grads = blocks.output_grads(dout, out)
    chunk = out.shape[2] // 2
    dq = torch.zeros(out.shape, dtype=ct, device=out.device)
    if comm_type == "all_gather":
        all_kv = _gather_async(kv, handle).wait()
        all_dkv = torch.zeros((n, 2, *kv_shape), dtype=ct, device=out.device)
    ring = _Ring(handle) if comm_type == "p2p" else None
    dkv_pending = None
    for step in range(n):
        src = (r - step) % n
        if ring is None:
            kv = all_kv[src]
        kv_pending = ring.exchange(kv, _KV_TAG) if ring is not None and step < n - 1 else None
        dkv = all_dkv[src] if ring is None else torch.zeros((2, *kv_shape), dtype=ct, device=out.device)
        rows, keys, causal = _blocks(r, src, chunk)
        dq_b, dk_b, dv_b = blocks.attend_backward(grads, queries, kv, out, lse, rows, keys, causal, scale)
        dq[..., rows, :] += dq_b
        dkv[0, :, :, keys] += dk_b
        dkv[1, :, :, keys] += dv_b
        if ring is not None and n > 1:
            # The accumulator of rank src's dK/dV moves with its K/V; after N hops it is home, complete.
            if dkv_pending is not None:
                dkv += dkv_pending.wait()
            dkv_pending = ring.exchange(dkv, _DKV_TAG)
        if kv_pending is not None:
            kv = kv_pending.wait()
    if ring is not None:
        dkv = dkv_pending.wait() if n > 1 else dkv  # one rank: its only block's dK/dV are already complete
    else:
        dkv = torch.empty(all_dkv.shape[1:], dtype=ct, device=out.device)
        reduce_scatter_tensor(dkv, all_dkv.view(-1, *all_dkv.shape[2:]), handle, _KIND)
    return dq, dkv[0], dkv[1]


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, handle: GroupHandle, comm_type: str, scale: float, blocks):
        out, lse, saved = _forward(q, k, v, handle, comm_type, scale, blocks)
        out = out.to(q.dtype)  # the merged output backward reads is the one the caller gets
        ctx.save_for_backward(*saved, out, lse)
        ctx.handle, ctx.comm_type, ctx.scale, ctx.blocks = handle, comm_type, scale, blocks
        ctx.kv_shape, ctx.dtypes = k.shape, (q.dtype, k.dtype, v.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        *queries, kv, out, lse = ctx.saved_tensors
        grads = _backward(tuple(queries), kv, out, lse, dout, ctx.kv_shape, ctx.handle, ctx.comm_type,
                          ctx.scale, ctx.blocks)
        return (*(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None, None, None, None)


# --compile: an eager island between the layer's graphs (collectives; FP8 blocks' byte messages), marked by
# megafp8.model.compile.mark_eager_islands.
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None, cp_rank: int,
                   cp_size: int, comm_type: str, counters: CommCounters | None,
                   scale: float | None = None, blocks=None) -> torch.Tensor:
    """Differentiable CP attention (shapes checked by the caller); see the module docstring. ``scale``: the
    logits' factor (None: 1/sqrt(d), as SDPA). ``blocks``: how the operands are held and attended
    (``HighPrecisionBlocks()`` by default; ``Fp8Blocks`` for FP8 attention, which also runs CP=1, group None,
    through here as a single diagonal block)."""
    blocks = HighPrecisionBlocks() if blocks is None else blocks
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cp_size == 1:
        handle = GroupHandle(group=None, ranks=(0,), rank=0, counters=counters or CommCounters())
        return _ContextParallelAttention.apply(q, k, v, handle, comm_type, scale, blocks)
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) != cp_size:
        raise ValueError(f"context parallel attention: the CP group has {len(ranks)} ranks, cp_size is {cp_size}")
    if ranks[cp_rank] != dist.get_rank():
        raise ValueError(f"context parallel attention: global rank {dist.get_rank()} is member "
                         f"{ranks.index(dist.get_rank()) if dist.get_rank() in ranks else 'none'} of the CP group "
                         f"{ranks}, but cp_rank is {cp_rank}")
    handle = GroupHandle(group=group, ranks=ranks, rank=cp_rank, counters=counters or CommCounters())
    return _ContextParallelAttention.apply(q, k, v, handle, comm_type, scale, blocks)
