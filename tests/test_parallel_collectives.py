"""Collectives and TP/SP mappings over gloo: results, backward duals, and byte counters vs analytic counts."""
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.parallel import collectives as C
from megafp8.parallel import mappings as M
from megafp8.parallel.collectives import CommCounters, GroupHandle
from megafp8.parallel.parallel_state import ParallelState


def test_counters_snapshot_reset_and_reject_unknown_kind():
    counters = CommCounters()
    counters.add("tp_sp_allgather", 10)
    counters.add("tp_sp_allgather", 5)
    assert counters.snapshot_and_reset()["tp_sp_allgather"] == 15
    assert set(counters.snapshot()) >= {"tp_sp_allgather", "tp_reduce_scatter", "tp_allreduce", "pp_p2p",
                                        "dp_grad_reduce", "dp_param_allgather", "amax_reduce"}
    assert sum(counters.snapshot().values()) == 0
    with pytest.raises(KeyError, match="unknown collective kind"):
        counters.add("tp_sp_allgathr", 1)


def test_size_one_group_is_free_and_identity():
    handle = GroupHandle.solo()
    x = torch.randn(4, 3)
    assert C.all_gather(x, handle, "tp_sp_allgather") is x
    assert C.reduce_scatter(x, handle, "tp_reduce_scatter") is x
    assert M.gather_from_sequence_parallel_region(x, handle) is x
    assert sum(handle.counters.snapshot().values()) == 0


def _rank_tensor(rank: int, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g, dtype=dtype)


def _collectives_body(rank: int, world_size: int) -> None:
    n = world_size
    ps = ParallelState(world_size=n, tensor_model_parallel_size=n).init_process_groups()
    tp, counters = ps.tp_group, ps.comm
    shards = [_rank_tensor(r, (3, 5)) for r in range(n)]

    # fp32 all-gather along dim 0 and along the last dim; bytes = shard bytes x (n - 1)
    gathered = C.all_gather(shards[rank], tp, "tp_sp_allgather", dim=0)
    torch.testing.assert_close(gathered, torch.cat(shards, 0), rtol=0, atol=0)
    assert counters["tp_sp_allgather"] == 3 * 5 * 4 * (n - 1)
    torch.testing.assert_close(C.all_gather(shards[rank], tp, "tp_allgather", dim=-1), torch.cat(shards, -1),
                               rtol=0, atol=0)
    assert counters["tp_allgather"] == 3 * 5 * 4 * (n - 1)

    # reduce-scatter: input [2n, 5] summed, dim-0 chunk kept; bytes = output bytes x (n - 1)
    full_inputs = [_rank_tensor(r, (2 * n, 5)) for r in range(n)]
    out = C.reduce_scatter(full_inputs[rank], tp, "tp_reduce_scatter", dim=0)
    torch.testing.assert_close(out, sum(full_inputs).chunk(n, 0)[rank])
    assert counters["tp_reduce_scatter"] == 2 * 5 * 4 * (n - 1)

    # all-reduce: 2 x bytes x (n - 1) / n
    C.all_reduce(torch.ones(6), tp, "tp_allreduce")
    assert counters["tp_allreduce"] == 2 * 6 * 4 * (n - 1) // n

    # FP8 all-gather: payload travels as uint8 (gloo rejects float8), one byte per element + fp32 scales
    counters.reset()
    data = (shards[rank] * 10).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor(0.5 + rank, dtype=torch.float32)
    all_data, all_scales = C.all_gather_quantized(data, scale_inv, tp)
    assert all_data.dtype == torch.float8_e4m3fn
    expected_bits = torch.cat([(s * 10).to(torch.float8_e4m3fn).view(torch.uint8) for s in shards])
    assert torch.equal(all_data.view(torch.uint8), expected_bits)
    torch.testing.assert_close(all_scales, torch.tensor([0.5 + r for r in range(n)]))
    assert counters["tp_sp_allgather"] == (3 * 5 * 1 + 4) * (n - 1)
    assert counters.calls("tp_sp_allgather") == 1, "bytes and scales travel in one collective"

    # async variants: the same results once waited on; per-row scales come back concatenated like the rows
    counters.reset()
    row_scales = torch.arange(3, dtype=torch.float32).view(3, 1) + 10 * rank
    pending = C.all_gather_quantized_async(data, row_scales, tp)
    summed = C.all_reduce_async(torch.full((4,), float(rank + 1)), tp, "tp_allreduce")
    out = torch.empty(2, 5)
    scattered = C.reduce_scatter_tensor_async(out, torch.stack([s[:2] for s in shards]).sum(0).repeat(n, 1), tp,
                                              "tp_reduce_scatter")
    all_data, all_scales = pending.wait()
    assert torch.equal(all_data.view(torch.uint8), expected_bits)
    assert torch.equal(all_scales, torch.cat([torch.arange(3.0).view(3, 1) + 10 * r for r in range(n)]))
    assert torch.equal(summed.wait(), torch.full((4,), float(n * (n + 1) // 2)))
    torch.testing.assert_close(scattered.wait(), n * torch.stack([s[:2] for s in shards]).sum(0))
    assert pending.wait() is not None and counters.calls("tp_sp_allgather") == 1
    # ... and at bf16 the same activation would cost 2 bytes per element: the FP8 ratio is ~0.5
    counters.reset()
    C.all_gather(shards[rank].to(torch.bfloat16), tp, "tp_sp_allgather")
    assert counters["tp_sp_allgather"] == 3 * 5 * 2 * (n - 1)


@pytest.mark.distributed
def test_collectives_and_byte_counters_world2():
    run_distributed(_collectives_body, world_size=2)


def _mappings_body(rank: int, world_size: int) -> None:
    """Each mapping's backward is checked against the grad of the equivalent single-process computation."""
    n = world_size
    tp = ParallelState(world_size=n, tensor_model_parallel_size=n).init_process_groups().tp_group
    full = [_rank_tensor(r, (2 * n, 3, 4)) for r in range(n)]  # rank r's tensor, [s, b, h]
    grad = [_rank_tensor(10 + r, (2 * n, 3, 4)) for r in range(n)]

    # gather_from_sequence_parallel_region: y = cat_r(x_r); column consumer -> dx_r = sum_q chunk_r(g_q)
    x = full[rank][:2].clone().requires_grad_()
    y = M.gather_from_sequence_parallel_region(x, tp)
    torch.testing.assert_close(y, torch.cat([f[:2] for f in full]))
    y.backward(grad[rank][: 2 * n])
    torch.testing.assert_close(x.grad, sum(g[: 2 * n] for g in grad)[2 * rank: 2 * rank + 2])

    # reduce_scatter_to_sequence_parallel_region: y_r = chunk_r(sum_q x_q); dx_r = cat_q(g_q)
    x = full[rank].clone().requires_grad_()
    y = M.reduce_scatter_to_sequence_parallel_region(x, tp)
    torch.testing.assert_close(y, sum(full).chunk(n, 0)[rank])
    y.backward(grad[rank][:2])
    torch.testing.assert_close(x.grad, torch.cat([g[:2] for g in grad]))

    # copy_to (identity fwd, all-reduce bwd) and reduce_from (all-reduce fwd, identity bwd)
    x = full[rank].clone().requires_grad_()
    M.copy_to_tensor_model_parallel_region(x, tp).backward(grad[rank])
    torch.testing.assert_close(x.grad, sum(grad))
    x = full[rank].clone().requires_grad_()
    y = M.reduce_from_tensor_model_parallel_region(x, tp)
    torch.testing.assert_close(y, sum(full))
    y.backward(grad[rank])
    torch.testing.assert_close(x.grad, grad[rank])

    # scatter_to_sequence_parallel_region: replicated x -> own chunk; backward all-gathers
    x = full[0].clone().requires_grad_()
    y = M.scatter_to_sequence_parallel_region(x, tp)
    torch.testing.assert_close(y, full[0].chunk(n, 0)[rank])
    y.backward(grad[rank][:2])
    torch.testing.assert_close(x.grad, torch.cat([g[:2] for g in grad]))

    # gather / scatter along the last dim
    x = full[rank].clone().requires_grad_()
    y = M.gather_from_tensor_model_parallel_region(x, tp)
    torch.testing.assert_close(y, torch.cat(full, -1))
    y.backward(torch.cat(grad, -1))
    torch.testing.assert_close(x.grad, grad[rank])


@pytest.mark.distributed
def test_mappings_forward_and_backward_world2():
    run_distributed(_mappings_body, world_size=2)
