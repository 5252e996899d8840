"""Tensor-parallel layers and vocab-parallel cross-entropy against single-process torch references."""
import pytest
import torch
import torch.nn.functional as F

from distributed_testing import run_distributed
from megafp8.parallel.collectives import GroupHandle
from megafp8.parallel.cross_entropy import vocab_parallel_cross_entropy
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.sharding import pad_vocab_size, resize_vocab_dim, shard_tensor, unshard_tensors, vocab_range
from megafp8.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@pytest.mark.parametrize("vocab, divisible_by, tp, padded", [
    (100, 128, 1, 128), (100, 8, 1, 104), (100, 8, 2, 112), (100, 8, 4, 128), (128, 32, 4, 128), (50257, 128, 8, 51200),
])
def test_pad_vocab_size(vocab, divisible_by, tp, padded):
    assert pad_vocab_size(vocab, divisible_by, tp) == padded
    assert vocab_range(padded, tp - 1, tp) == (padded - padded // tp, padded)


def test_shard_unshard_roundtrip_with_stride():
    """Stride 2 (fused gate/up): rank r holds [gate_r; up_r]."""
    gate, up = torch.arange(8.0).view(8, 1), torch.arange(100.0, 108.0).view(8, 1)
    full = torch.cat([gate, up])
    shards = [shard_tensor(full, 4, r, dim=0, stride=2) for r in range(4)]
    assert torch.equal(shards[1], torch.cat([gate[2:4], up[2:4]]))
    assert torch.equal(unshard_tensors(shards, dim=0, stride=2), full)
    assert resize_vocab_dim(full, 20).shape == (20, 1) and resize_vocab_dim(full, 10).shape == (10, 1)


def test_cross_entropy_single_rank_ignores_vocab_padding():
    logits = torch.randn(5, 3, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (5, 3))
    loss = vocab_parallel_cross_entropy(logits, target, GroupHandle.solo(), vocab_size=11)
    ref_logits = logits.detach()[..., :11].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 11), target.reshape(-1), reduction="none").view(5, 3)
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
    weights = torch.rand(5, 3)
    (loss * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(logits.grad[..., :11], ref_logits.grad)
    assert torch.all(logits.grad[..., 11:] == 0)


def _layers_body(rank: int, world_size: int) -> None:
    n = world_size
    ps = ParallelState(world_size=n, tensor_model_parallel_size=n).init_process_groups()
    tp = ps.tp_group
    g = torch.Generator().manual_seed(0)  # every rank draws the same full tensors

    # --- vocab-parallel CE: vocab 90 padded to 256 -> ranks 2 and 3 hold only padding columns
    vocab, padded = 90, pad_vocab_size(90, 64, n)
    logits_full = torch.randn(6, 2, padded, generator=g, dtype=torch.float64) * 5
    target = torch.randint(0, vocab, (6, 2), generator=g)
    local = logits_full.chunk(n, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, tp, vocab_size=vocab)
    ref_logits = logits_full[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none").view(6, 2)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    weights = torch.rand(6, 2, generator=g, dtype=torch.float64)
    (loss.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    full_grad = torch.cat([ref_logits.grad, torch.zeros(6, 2, padded - vocab, dtype=torch.float64)], -1)
    torch.testing.assert_close(local.grad, full_grad.chunk(n, -1)[rank], rtol=1e-6, atol=1e-9)

    # --- column (gather_output, bias) then row (input not parallel, bias) vs two nn.Linear-equivalents
    w1, b1 = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
    w2, b2 = torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
    x = torch.randn(4, 3, 6, generator=g)
    col = ColumnParallelLinear(6, 8, ps, bias=True, gather_output=True)
    row = RowParallelLinear(8, 5, ps, bias=True, input_is_parallel=False)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(n, 0)[rank]), col.bias.copy_(b1.chunk(n, 0)[rank])
        row.weight.copy_(w2.chunk(n, 1)[rank]), row.bias.copy_(b2)
    x_tp = x.clone().requires_grad_()
    y = row(col(x_tp))
    x_ref, w1_ref, w2_ref = (t.clone().requires_grad_() for t in (x, w1, w2))
    y_ref = F.linear(F.linear(x_ref, w1_ref, b1), w2_ref, b2)
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(x_tp.grad, x_ref.grad)
    torch.testing.assert_close(col.weight.grad, w1_ref.grad.chunk(n, 0)[rank])
    torch.testing.assert_close(row.weight.grad, w2_ref.grad.chunk(n, 1)[rank])

    # --- sequence parallel, high precision: column (bias) saves only its input shard (Megatron's choice) and
    # re-gathers it for wgrad; row reduce-scatters. The same reference, the sequence split over ranks.
    sp_ps = ParallelState(world_size=n, tensor_model_parallel_size=n, sequence_parallel=True).init_process_groups()
    col = ColumnParallelLinear(6, 8, sp_ps, bias=True)
    row = RowParallelLinear(8, 5, sp_ps, bias=True)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(n, 0)[rank]), col.bias.copy_(b1.chunk(n, 0)[rank])
        row.weight.copy_(w2.chunk(n, 1)[rank]), row.bias.copy_(b2)
    x_shard = x.chunk(n, 0)[rank].clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        hidden = col(x_shard)
    assert not any(t.shape[0] == x.shape[0] and t.shape[-1] == 6 for t in saved), "the gathered input is not kept"
    assert any(t.data_ptr() == x_shard.data_ptr() for t in saved), "the local shard is"
    sp_ps.comm.reset()
    y = row(hidden)
    y.backward(torch.ones_like(y))
    x_ref, w1_ref, b1_ref, w2_ref = (t.clone().requires_grad_() for t in (x, w1, b1, w2))
    y_ref = F.linear(F.linear(x_ref, w1_ref, b1_ref), w2_ref, b2)
    y_ref.sum().backward()
    for t, t_ref in ((y, y_ref.detach()), (x_shard.grad, x_ref.grad)):
        torch.testing.assert_close(t, t_ref.chunk(n, 0)[rank])
    torch.testing.assert_close(col.weight.grad, w1_ref.grad.chunk(n, 0)[rank])
    torch.testing.assert_close(col.bias.grad, b1_ref.grad.chunk(n, 0)[rank])
    # backward gathers: the row layer's output-gradient shard, the column layer's re-gathered input shard (fp32)
    assert sp_ps.comm["tp_sp_allgather"] == 4 * (y.numel() + x_shard.numel()) * (n - 1)

    # --- vocab-parallel embedding (no SP: all-reduce; SP: reduce-scatter along dim 0)
    table = torch.randn(padded, 4, generator=g)
    ids = torch.randint(0, vocab, (n * 2, 3), generator=g)
    for sp in (False, True):
        emb = VocabParallelEmbedding(padded, 4, ps, sequence_parallel=sp)
        with torch.no_grad():
            emb.weight.copy_(table.chunk(n, 0)[rank])
        expected = F.embedding(ids, table)
        torch.testing.assert_close(emb(ids), expected.chunk(n, 0)[rank] if sp else expected, rtol=0, atol=0)


@pytest.mark.distributed
def test_layers_and_cross_entropy_tp4():
    run_distributed(_layers_body, world_size=4)
