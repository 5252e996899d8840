"""Context-parallel attention (ring p2p and all-gather) vs a plain full-sequence causal softmax attention in fp64."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed_testing import run_distributed
from megafp8.parallel import ring_attention
from megafp8.parallel.collectives import CommCounters
from megafp8.parallel.context_parallel import (context_parallel_attention, gather_from_context_parallel,
                                               load_balanced_chunk_ids, local_positions, split_for_context_parallel)


def _reference(q, k, v):
    """Full-sequence causal attention in fp64, one process; KV head of query head i is i // (H / G)."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _inputs(b, heads, kv_heads, seq, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, seq, d, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads, heads)]


def _expected_bytes(comm_type, n, kv_local_elems, wire_size, grad_size):
    kv, dkv = kv_local_elems * wire_size, kv_local_elems * grad_size
    forward = (n - 1) * kv
    backward = (n - 1) * kv + (n * dkv if comm_type == "p2p" else (n - 1) * dkv)
    return forward, backward


def _check(group, cp_rank, cp_size, comm_type, heads, kv_heads, chunk, dtype, seed):
    b, d = 2, 8
    seq = 2 * cp_size * chunk
    q, k, v, dout = _inputs(b, heads, kv_heads, seq, d, seed)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full)
    ref.backward(dout)
    local = [split_for_context_parallel(t, 2, cp_rank, cp_size).to(dtype).requires_grad_() for t in (q, k, v)]
    counters = CommCounters()
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = context_parallel_attention(*local, group=group, cp_rank=cp_rank, cp_size=cp_size, comm_type=comm_type,
                                         counters=counters, enable_gqa=heads != kv_heads)
    fwd_bytes = counters["cp_kv_p2p"]
    out.backward(split_for_context_parallel(dout, 2, cp_rank, cp_size).to(dtype))
    assert out.dtype == dtype and out.shape == local[0].shape
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    what = f"{comm_type} CP={cp_size} rank {cp_rank} heads {heads}/{kv_heads} chunk {chunk} {dtype}"
    torch.testing.assert_close(out.double(), split_for_context_parallel(ref.detach(), 2, cp_rank, cp_size),
                               atol=tol, rtol=tol, msg=lambda m: f"{what} output: {m}")
    for name, mine, theirs in zip("qkv", local, full):
        torch.testing.assert_close(mine.grad.double(), split_for_context_parallel(theirs.grad, 2, cp_rank, cp_size),
                                   atol=tol, rtol=tol, msg=lambda m, name=name: f"{what} d{name}: {m}")
    # The local pieces put back together are the full sequence.
    assert torch.equal(gather_from_context_parallel(local[0].detach(), 2, cp_rank, cp_size, group),
                       q.to(dtype))
    kv_elems = 2 * b * kv_heads * (seq // cp_size) * d
    grad_size = torch.promote_types(dtype, torch.float32).itemsize
    # Saved for backward: q, k, v, the output and the per-row lse, nothing of size s x s.
    q_elems = b * heads * (seq // cp_size) * d
    assert sum(saved.values()) == (2 * q_elems + kv_elems) * dtype.itemsize + q_elems // d * grad_size, what
    assert (fwd_bytes, counters["cp_kv_p2p"] - fwd_bytes) == _expected_bytes(
        comm_type, cp_size, kv_elems, dtype.itemsize, grad_size), what


def _body(rank, world_size):
    group = dist.group.WORLD
    for comm_type in ("p2p", "all_gather"):
        for heads, kv_heads, chunk in ((4, 2, 3), (2, 2, 5)):
            _check(group, rank, world_size, comm_type, heads, kv_heads, chunk, torch.float64, seed=chunk)
    _check(group, rank, world_size, "p2p", 4, 2, 4, torch.float32, seed=1)
    _check(group, rank, world_size, "p2p", 4, 1, 4, torch.bfloat16, seed=2)
    # Query-row tiles smaller than a chunk (tiles straddle the two chunks and the diagonal's mask offset).
    ring_attention.Q_TILE_ROWS = 4
    for comm_type in ("p2p", "all_gather"):
        _check(group, rank, world_size, comm_type, 4, 2, 5, torch.float64, seed=3)
    ring_attention.Q_TILE_ROWS = 1024
    if world_size == 2:
        q, k, v, _ = _inputs(1, 2, 2, 4, 8, seed=0)
        with pytest.raises(ValueError, match="but cp_rank is"):
            context_parallel_attention(q, k, v, group=group, cp_rank=1 - rank, cp_size=2)
    if world_size == 4:
        # CP groups whose global ranks are strided (TP innermost): {0, 2} and {1, 3}.
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _check(groups[rank % 2], rank // 2, 2, "p2p", 4, 2, 3, torch.float64, seed=7)


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 4])
def test_ring_attention_matches_fp64_reference(cp_size):
    run_distributed(_body, world_size=cp_size, timeout_s=300)


def test_layout_helpers():
    assert [load_balanced_chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = torch.arange(16).view(1, 16)
    parts = [split_for_context_parallel(x, 1, r, 2) for r in range(2)]
    assert parts[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] and parts[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert torch.equal(local_positions(16, 1, 2), parts[1][0])
    assert torch.equal(split_for_context_parallel(x, 1, 0, 1), x)
    with pytest.raises(ValueError, match="context-parallel-size"):
        split_for_context_parallel(x, 1, 0, 3)
    with pytest.raises(ValueError, match="cp_rank"):
        local_positions(16, 2, 2)


def test_cp1_is_sdpa_and_bad_input_is_refused():
    q, k, v, _ = _inputs(1, 4, 2, 6, 8, seed=0)
    out = context_parallel_attention(q, k, v, group=None, cp_rank=0, cp_size=1, enable_gqa=True)
    torch.testing.assert_close(out, _reference(q, k, v))
    with pytest.raises(ValueError, match="enable_gqa"):
        context_parallel_attention(q, k, v, group=None, cp_rank=0, cp_size=1)
    with pytest.raises(ValueError, match="--cp-comm-type"):
        context_parallel_attention(q, k, v, group=None, cp_rank=0, cp_size=1, comm_type="ring", enable_gqa=True)
