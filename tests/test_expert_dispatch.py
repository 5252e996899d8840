"""The expert-parallel exchange on real process groups: every row reaches its expert's rank grouped by local expert and
comes back in order; gradients return through the reverse exchange; FP8 dispatch sends E4M3 bytes plus 1x128 block
scales, counted exactly, at most 0.52x BF16's bytes. The allgather dispatcher delivers the same rows in the same
order, sums each token's weighted outputs back, and counts its collectives' bytes exactly."""
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.parallel.collectives import CommCounters
from megafp8.parallel.expert_dispatch import AllGatherExchange, ExpertExchange
from megafp8.parallel.parallel_state import ParallelState
from megafp8_kernels import quantize
from megafp8_kernels.gemm_reference import dequantize

EXPERTS, HIDDEN = 6, 128


def _rows_of(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows sorted by global expert: (rows, their experts, counts per expert)."""
    generator = torch.Generator().manual_seed(rank)
    experts = torch.sort(torch.randint(0, EXPERTS, (11 + 5 * rank,), generator=generator)).values
    experts[:2] = 0  # rank 0's expert 0 gets rows from every rank
    experts = torch.sort(experts).values
    rows = torch.randn(experts.numel(), HIDDEN, generator=generator) + experts[:, None] * 10
    return rows, experts, torch.bincount(experts, minlength=EXPERTS)


def _exchange_body(rank: int, world_size: int) -> None:
    ps = ParallelState(world_size=world_size, expert_model_parallel_size=world_size, expert_tensor_parallel_size=1)
    ps.init_process_groups()
    ep = ps.group("ep")
    local_experts = range(rank * EXPERTS // world_size, (rank + 1) * EXPERTS // world_size)
    everyone = [_rows_of(r) for r in range(world_size)]
    rows, _, counts = everyone[rank]
    for fp8 in (False, True):
        ps.comm.reset()
        exchange = ExpertExchange(counts, ep)
        sent = rows.clone().requires_grad_()
        received = exchange.dispatch(sent, fp8=fp8)
        # Grouped by local expert, each expert's rows in source-rank order.
        want = torch.cat([r[e == expert] for expert in local_experts for r, e, _ in everyone])
        if fp8:
            q = quantize(want, torch.float8_e4m3fn, "block_1x128", power_of_2_scale=True)
            want = dequantize(q.data, q.scale_inv, "block_1x128")
        assert torch.equal(received, want), fp8
        assert exchange.local_counts.tolist() == [sum(int((e == x).sum()) for _, e, _ in everyone)
                                                  for x in local_experts]
        remote = sum(n for r, n in enumerate(exchange.input_splits) if r != rank)
        row_bytes = HIDDEN + 4 * (HIDDEN // 128) if fp8 else HIDDEN * 4
        assert ps.comm.snapshot_and_reset()["ep_alltoall"] == remote * row_bytes
        if fp8:  # what a BF16 dispatch would send: 2 bytes an element
            assert row_bytes / (2 * HIDDEN) <= 0.52
        back = exchange.combine(received * 2)
        assert torch.equal(back, 2 * (rows if not fp8 else _roundtrip(rows)))
        back.sum().backward()  # each row's gradient returns through both exchanges: 2 everywhere
        assert torch.equal(sent.grad, torch.full_like(rows, 2.0))


def _roundtrip(rows: torch.Tensor) -> torch.Tensor:
    q = quantize(rows, torch.float8_e4m3fn, "block_1x128", power_of_2_scale=True)
    return dequantize(q.data, q.scale_inv, "block_1x128")


@pytest.mark.distributed
def test_exchange_over_two_ranks_delivers_groups_returns_and_counts_bytes():
    run_distributed(_exchange_body, world_size=2)


def test_exchange_on_one_rank_is_the_identity():
    ps = ParallelState().init_process_groups()
    rows, _, counts = _rows_of(0)
    exchange = ExpertExchange(counts, ps.group("ep"))
    assert torch.equal(exchange.combine(exchange.dispatch(rows)), rows)
    assert isinstance(ps.comm, CommCounters) and ps.comm.snapshot_and_reset()["ep_alltoall"] == 0


TOKENS, TOPK = 8, 2


def _routing_of(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens, each token's two experts and weights, and which choices capacity kept."""
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randn(TOKENS, HIDDEN, generator=generator)
    experts = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOPK] for _ in range(TOKENS)])
    probs = torch.rand(TOKENS, TOPK, generator=generator)
    kept = torch.rand(TOKENS * TOPK, generator=generator) > 0.2
    return tokens, experts, probs, kept


def _allgather_body(rank: int, world_size: int) -> None:
    ps = ParallelState(world_size=world_size, expert_model_parallel_size=world_size, expert_tensor_parallel_size=1)
    ps.init_process_groups()
    per_rank = EXPERTS // world_size
    everyone = [_routing_of(r) for r in range(world_size)]
    mine = everyone[rank]
    for fp8 in (False, True):
        ps.comm.reset()
        tokens, probs = mine[0].clone().requires_grad_(), mine[2].clone().requires_grad_()
        exchange = AllGatherExchange(ps.group("ep"), rank * per_rank, per_rank)
        rows, counts = exchange.gather(tokens, mine[1], probs, mine[3], fp8=fp8)
        # ExpertExchange's order: by local expert, then source rank, then token (and choice) order.
        want = torch.cat([t[c // TOPK] for expert in range(rank * per_rank, (rank + 1) * per_rank)
                          for t, e, _, k in everyone
                          for c in [((e.reshape(-1) == expert) & k).nonzero().squeeze(1)]])
        assert torch.equal(rows, _roundtrip(want) if fp8 else want), fp8
        assert counts.tolist() == [sum(int(((e.reshape(-1) == x) & k).sum()) for _, e, _, k in everyone)
                                   for x in range(rank * per_rank, (rank + 1) * per_rank)]
        out = exchange.combine(rows * 2, torch.float32)
        # Each token: 2 x its value x the weights of its kept choices, whichever rank's experts they reached.
        source = _roundtrip(mine[0]) if fp8 else mine[0]
        weight = (mine[2].reshape(-1) * mine[3]).view(TOKENS, TOPK).sum(1, keepdim=True)
        torch.testing.assert_close(out, 2 * source * weight, rtol=1e-6, atol=1e-6)
        token_bytes = HIDDEN + 4 * (HIDDEN // 128) if fp8 else HIDDEN * 4
        others = world_size - 1
        expected = others * TOKENS * (token_bytes + TOPK * 4 + TOPK * 2 * 8 + HIDDEN * 4)  # tokens, probs, routing, sums
        assert ps.comm.snapshot_and_reset()["ep_allgather"] == expected
        out.sum().backward()
        torch.testing.assert_close(tokens.grad, (2 * weight).expand(-1, HIDDEN), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(probs.grad, (2 * source.sum(1, keepdim=True) * mine[3].view(TOKENS, TOPK)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_allgather_dispatcher_delivers_the_alltoall_rows_and_sums_tokens_back():
    run_distributed(_allgather_body, world_size=2)
