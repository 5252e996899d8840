"""Context parallelism (issue 22): the load-balanced sequence layout and the CP attention entry point.

Each sequence of length ``S`` (divisible by ``2N``, ``N`` = CP size) is cut into ``2N`` chunks of
``c = S / 2N`` tokens; CP rank ``r`` holds chunks ``r`` and ``2N-1-r`` concatenated, ``s_local = S / N``
tokens (Megatron-LM's layout: under a causal mask every rank then has the same attention work). The
model runs on local tokens only; RoPE needs their global positions (``local_positions``) and attention
needs the other ranks' K/V (``context_parallel_attention``, implemented in ``ring_attention``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megafp8.parallel.collectives import CommCounters
from megafp8.parallel import ring_attention as ring  # through the module: --compile may wrap it (eager island)

COMM_TYPES = ("p2p", "all_gather")


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallel: cp_rank {cp_rank} is not in [0, cp_size={cp_size})")


def _chunk_length(seq_length: int, cp_size: int) -> int:
    if seq_length % (2 * cp_size):
        raise ValueError(f"context parallel: sequence length {seq_length} is not divisible by "
                         f"2 x --context-parallel-size = {2 * cp_size}")
    return seq_length // (2 * cp_size)


def load_balanced_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the ``2N`` sequence chunks rank ``cp_rank`` holds: ``(r, 2N-1-r)``."""
    _check_rank(cp_rank, cp_size)
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_context_parallel(t: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's two chunks of the full sequence along ``dim``, concatenated (``t`` itself at CP=1)."""
    _check_rank(cp_rank, cp_size)
    if cp_size == 1:
        return t
    _chunk_length(t.shape[dim], cp_size)
    chunks = t.chunk(2 * cp_size, dim=dim)
    first, second = load_balanced_chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def gather_from_context_parallel(t: torch.Tensor, dim: int, cp_rank: int, cp_size: int,
                                 group: dist.ProcessGroup | None) -> torch.Tensor:
    """Inverse of ``split_for_context_parallel``: the full sequence along ``dim`` on every CP rank.

    Not differentiable and not counted (for tests and evaluation, not the training step)."""
    _check_rank(cp_rank, cp_size)
    if cp_size == 1:
        return t
    if t.shape[dim] % 2:
        raise ValueError(f"gather_from_context_parallel: local length {t.shape[dim]} along dim {dim} is odd")
    local = t.contiguous()
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local, group=group)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = load_balanced_chunk_ids(rank, cp_size)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def local_positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions (int64) of this rank's ``seq_length / cp_size`` local tokens, for RoPE indexing."""
    _check_rank(cp_rank, cp_size)
    chunk = _chunk_length(seq_length, cp_size)
    first, second = load_balanced_chunk_ids(cp_rank, cp_size)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               group: dist.ProcessGroup | None, cp_rank: int, cp_size: int,
                               comm_type: str = "p2p", counters: CommCounters | None = None,
                               enable_gqa: bool = False, scale: float | None = None, blocks=None) -> torch.Tensor:
    """Causal attention over the GLOBAL sequence for this rank's load-balanced local tokens.

    q ``[b, heads, s_local, d]``, k/v ``[b, kv_heads, s_local, d]``, already rotated with their global
    positions; returns ``[b, heads, s_local, d]`` in q's dtype. Query head ``i`` uses KV head
    ``i // (heads / kv_heads)`` (``enable_gqa`` must be set when they differ, as for SDPA). ``group`` is the
    ProcessGroup of the CP ranks in cp_rank order; its K/V traffic is charged to ``counters`` (the
    ``ParallelState.comm`` counters, or None) under ``cp_kv_p2p``. ``comm_type``: ``p2p`` (ring, the
    exchange of the next K/V block overlapping the current block's math) or ``all_gather``. The attention
    math runs in fp32 (fp64 for fp64 inputs) whatever the input dtype; at CP=1 this is SDPA. ``scale``: the
    logits' factor (None: 1/sqrt(d)). ``blocks``: ring attention's operand handling (None: high precision;
    ``megafp8.fp8.dot_product_attention.Fp8Blocks``: FP8 attention, whose ring carries FP8 K/V bytes).
    """
    _check_rank(cp_rank, cp_size)
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {', '.join(COMM_TYPES)}, got {comm_type!r}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] \
            or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"context parallel attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "are not [b, heads, s_local, d] / [b, kv_heads, s_local, d]")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads or (heads != kv_heads and not enable_gqa):
        raise ValueError(f"context parallel attention: {heads} query heads over {kv_heads} KV heads needs "
                         "enable_gqa=True and a whole number of query heads per KV head")
    if cp_size == 1 and blocks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa, scale=scale)
    if cp_size == 1:  # FP8 blocks: one diagonal block, no group
        return ring.ring_attention(q, k, v, None, 0, 1, comm_type, counters, scale, blocks)
    if q.shape[2] % 2:
        raise ValueError(f"context parallel attention: local sequence length {q.shape[2]} is not two equal chunks")
    if group is None:
        raise ValueError(f"context parallel attention: cp_size {cp_size} needs the CP process group")
    return ring.ring_attention(q, k, v, group, cp_rank, cp_size, comm_type, counters, scale, blocks)
