"""Context-parallel attention (ring p2p and all-gather) vs a plain full-sequence causal softmax attention in fp64:
each block through SDPA's fused flash kernel in the input dtype (bf16 runs no fp32 matmul) and through the fp32 twin
(attention_blocks.FUSED = False, in small query tiles)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from attention_testing import attention_inputs, reference_attention
from distributed_testing import run_distributed
from megafp8.parallel import attention_blocks
from megafp8.parallel.collectives import CommCounters
from megafp8.parallel.context_parallel import (context_parallel_attention, gather_from_context_parallel,
                                               load_balanced_chunk_ids, local_positions, split_for_context_parallel)


def _expected_bytes(comm_type, n, kv_local_elems, wire_size, grad_size):
    kv, dkv = kv_local_elems * wire_size, kv_local_elems * grad_size
    forward = (n - 1) * kv
    backward = (n - 1) * kv + (n * dkv if comm_type == "p2p" else (n - 1) * dkv)
    return forward, backward


def _check(group, cp_rank, cp_size, comm_type, heads, kv_heads, chunk, dtype, seed, scale=None):
    b, d = 2, 8
    seq = 2 * cp_size * chunk
    q, k, v, dout = attention_inputs(b, heads, kv_heads, seq, d, seed)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*full, scale=scale)
    ref.backward(dout)
    local = [split_for_context_parallel(t, 2, cp_rank, cp_size).to(dtype).requires_grad_() for t in (q, k, v)]
    counters = CommCounters()
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = context_parallel_attention(*local, group=group, cp_rank=cp_rank, cp_size=cp_size, comm_type=comm_type,
                                         counters=counters, enable_gqa=heads != kv_heads, scale=scale)
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


class _Fp32Matmuls(TorchDispatchMode):
    """Counts matmul-family aten ops on fp32 operands, and the flash kernel calls."""
    MATMULS = {"aten::mm", "aten::bmm", "aten::matmul", "aten::addmm", "aten::baddbmm"}

    def __init__(self):
        super().__init__()
        self.count, self.flash = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            self.count += 1
        self.flash += name.startswith("aten::_scaled_dot_product_flash_attention")
        return func(*args, **(kwargs or {}))


def _body(rank, world_size):
    group = dist.group.WORLD
    for comm_type in ("p2p", "all_gather"):
        for heads, kv_heads, chunk in ((4, 2, 3), (2, 2, 5)):
            _check(group, rank, world_size, comm_type, heads, kv_heads, chunk, torch.float64, seed=chunk)
        _check(group, rank, world_size, comm_type, 4, 2, 3, torch.float64, seed=4, scale=0.8)  # --softmax-scale
    _check(group, rank, world_size, "p2p", 4, 2, 4, torch.float32, seed=1)
    matmuls = _Fp32Matmuls()
    with matmuls:  # bf16 blocks run in the flash kernel: no fp32 matmul, forward or backward
        _check(group, rank, world_size, "p2p", 4, 1, 4, torch.bfloat16, seed=2)
    assert matmuls.count == 0 and matmuls.flash >= 2 * world_size, (matmuls.count, matmuls.flash)
    # The fp32 twin, in query-row tiles smaller than a chunk (tiles straddle the two chunks and the diagonal's mask).
    attention_blocks.FUSED, attention_blocks.Q_TILE_ROWS = False, 4
    try:
        for comm_type in ("p2p", "all_gather"):
            _check(group, rank, world_size, comm_type, 4, 2, 5, torch.float64, seed=3)
        _check(group, rank, world_size, "p2p", 4, 1, 4, torch.bfloat16, seed=2)
    finally:
        attention_blocks.FUSED, attention_blocks.Q_TILE_ROWS = True, 1024
    if world_size == 2:
        q, k, v, _ = attention_inputs(1, 2, 2, 4, 8, seed=0)
        with pytest.raises(ValueError, match="but cp_rank is"):
            context_parallel_attention(q, k, v, group=group, cp_rank=1 - rank, cp_size=2)
    if world_size == 4:
        # CP groups whose global ranks are strided (TP innermost): {0, 2} and {1, 3}.
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _check(groups[rank % 2], rank // 2, 2, "p2p", 4, 2, 3, torch.float64, seed=7)


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, pytest.param(4, marks=pytest.mark.slow)])  # CP4 in the model: test_context_parallel_model
def test_ring_attention_matches_fp64reference_attention(cp_size):
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
    q, k, v, _ = attention_inputs(1, 4, 2, 6, 8, seed=0)
    out = context_parallel_attention(q, k, v, group=None, cp_rank=0, cp_size=1, enable_gqa=True)
    torch.testing.assert_close(out, reference_attention(q, k, v))
    with pytest.raises(ValueError, match="enable_gqa"):
        context_parallel_attention(q, k, v, group=None, cp_rank=0, cp_size=1)
    with pytest.raises(ValueError, match="--cp-comm-type"):
        context_parallel_attention(q, k, v, group=None, cp_rank=0, cp_size=1, comm_type="ring", enable_gqa=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_blocks_merged_by_lse_equal_full_attention(device):
    """Two K/V blocks (the first causal and square, the second not), each through attend / attend_backward with the
    merged output and lse, give full attention and its gradients: the kernels (bf16) within bf16 rounding of the
    fp64 twin, on CPU and on CUDA (its flash forward/backward calls are only reached there)."""
    b, heads, groups, s, d = 2, 4, 2, 16, 64
    gen = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(b, heads, s, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, groups, 2 * s, d, generator=gen) for _ in range(2))
    scale = d ** -0.5

    def blockwise(dtype, fused):
        attention_blocks.FUSED = fused
        try:
            qx, kx, vx, dx = (t.to(device, dtype) for t in (q, k, v, dout))
            ct = attention_blocks.compute_dtype(dtype)
            out, lse = torch.zeros(qx.shape, dtype=ct, device=device), torch.full(qx.shape[:-1], float("-inf"),
                                                                                  dtype=ct, device=device)
            # keys [0, s) are a causal square block for the queries; keys [s, 2s) an unmasked one
            blocks = [(slice(0, s), True), (slice(s, 2 * s), False)]
            for keys, causal in blocks:
                block_out, block_lse = attention_blocks.attend(qx, kx[:, :, keys], vx[:, :, keys], causal, scale)
                attention_blocks.merge(out, lse, block_out.to(ct), block_lse.to(ct))
            out = out.to(dtype)
            dq, dk, dv = torch.zeros_like(qx, dtype=ct), torch.zeros_like(kx, dtype=ct), torch.zeros_like(vx, dtype=ct)
            for keys, causal in blocks:
                dq_b, dk_b, dv_b = attention_blocks.attend_backward(dx, qx, kx[:, :, keys], vx[:, :, keys], out, lse,
                                                                    causal, scale)
                dq += dq_b
                dk[:, :, keys] += dk_b
                dv[:, :, keys] += dv_b
            return [t.double().cpu() for t in (out, dq, dk, dv)]
        finally:
            attention_blocks.FUSED = True

    exact = blockwise(torch.float64, fused=False)
    # The same attention written as one masked softmax: query i sees keys 0..i and s..2s-1.
    rep = heads // groups
    kf, vf = (t.double().repeat_interleave(rep, 1).requires_grad_() for t in (k, v))
    qf = q.double().requires_grad_()
    mask = torch.zeros(s, 2 * s, dtype=torch.bool)
    mask[:, :s] = torch.ones(s, s, dtype=torch.bool).triu(1)
    full = torch.softmax((qf @ kf.transpose(-1, -2) * scale).masked_fill(mask, float("-inf")), -1) @ vf
    full.backward(dout.double())
    reference = [full.detach(), qf.grad, kf.grad.view(b, groups, rep, 2 * s, d).sum(2),
                 vf.grad.view(b, groups, rep, 2 * s, d).sum(2)]
    for name, got, want in zip(("out", "dq", "dk", "dv"), exact, reference):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"twin {n}: {m}")
    for name, got, want in zip(("out", "dq", "dk", "dv"), blockwise(torch.bfloat16, fused=True), reference):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=lambda m, n=name: f"{device} bf16 {n}: {m}")
