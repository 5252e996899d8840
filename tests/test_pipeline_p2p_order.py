"""No pipeline hang on NCCL, checked on CPU: the p2p calls each rank issues in a training step and an evaluation,
for every schedule at PP=2 and PP=4, replayed through an unbuffered model of NCCL (tests/p2p_fifo_model.py) complete.
gloo buffers sends, so the CPU runs themselves cannot hang; an evaluation that sent each output as soon as it was
computed passed every CPU test and hung both ranks of an interleaved PP=2 on NCCL (the model finds that order)."""
import pytest
import torch
import torch.distributed as dist

from distributed_testing import run_distributed
from p2p_fifo_model import P2POp, find_hang, record_p2p_calls
from pipeline_testing import Case, config
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import build_pipeline


def _send(peer, n=1024):
    return [P2POp("send", peer, n)]


def _recv(peer, n=1024):
    return [P2POp("recv", peer, n)]


def test_model_finds_the_send_between_receives_hang():
    # Interleaved PP=2, 2 micro-batches, the old evaluation: rank 0 sends stage 0's outputs, then receives stage 1's;
    # rank 1 receives one and sends it back at once.
    old = {0: [_send(1), _send(1), _recv(1), _recv(1)], 1: [_recv(0), _send(0), _recv(0), _send(0)]}
    assert "hang" in find_hang(old)
    fixed = {0: [_send(1), _send(1), _recv(1), _recv(1)], 1: [_recv(0), _recv(0), _send(0), _send(0)]}
    assert find_hang(fixed) is None
    # A mixed batch is one NCCL group: its send and receive match in either order.
    grouped = {0: [[P2POp("send", 1, 8), P2POp("recv", 1, 8)]], 1: [[P2POp("send", 0, 8), P2POp("recv", 0, 8)]]}
    assert find_hang(grouped) is None
    assert "which receives" in find_hang({0: [_send(1, 8)], 1: [_recv(0, 16)]})


CASES = {
    2: [Case(), Case(schedule="interleaved", vpp=1), Case(schedule="interleaved-zb", vpp=1), Case(schedule="zbv"),
        Case(schedule="dualpipev"), Case(fp8=True, schedule="interleaved", vpp=1)],
    4: [Case(pp=4, layers=8), Case(pp=4, layers=8, schedule="interleaved", vpp=1),
        Case(pp=4, layers=8, schedule="zbv", microbatches=8), Case(pp=4, layers=8, schedule="dualpipev", microbatches=8)],
}


def _body(rank: int, world_size: int) -> None:
    from megafp8.fp8 import Fp8Recipe

    for case in CASES[world_size]:
        cfg = config(case)
        ps = ParallelState(world_size=world_size, pipeline_model_parallel_size=case.pp,
                           num_layers_per_virtual_pipeline_stage=case.vpp,
                           pipeline_schedule=case.schedule).init_process_groups()
        pipe = build_pipeline(cfg, ps, micro_batch_size=case.micro_batch_size, num_microbatches=case.microbatches,
                              fp8_recipe=Fp8Recipe.delayed(amax_history_len=4) if case.fp8 else None)
        ids = torch.randint(0, cfg.vocab_size, (case.microbatches, cfg.seq_length),
                            generator=torch.Generator().manual_seed(3))
        calls, undo = record_p2p_calls()
        try:
            pipe.step(ids, ids.roll(-1, dims=1))
            pipe.evaluate(ids, ids.roll(-1, dims=1))
        finally:
            undo()
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, calls)
        hang = find_hang(dict(enumerate(gathered)))
        assert hang is None, f"[{case}] {hang}"
        assert sum(len(c) for c in calls) > 0, f"[{case}] no p2p recorded"


@pytest.mark.distributed
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_issues_p2p_that_nccl_completes(pp):
    run_distributed(_body, world_size=pp, timeout_s=600)
