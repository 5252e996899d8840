"""Vocab-parallel cross-entropy in row chunks: loss and logits gradient against F.cross_entropy in fp64 on
the unpadded logits (fp32 and bf16 logits, vocab padding, TP=1 and a TP=2 gloo run, several chunks and a
ragged last one), two all-reduces per call whatever the chunk count, and no fp32 temporary larger than a
chunk during forward and backward (a TorchDispatchMode watching every op's output)."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from data_fixtures import REPO_ROOT
from distributed_testing import run_distributed
from megafp8.parallel import cross_entropy
from megafp8.parallel.collectives import GroupHandle
from megafp8.parallel.cross_entropy import vocab_parallel_cross_entropy
from megafp8.parallel.parallel_state import ParallelState

sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "bench"))
from bench_cross_entropy import LargestFloat32Output  # noqa: E402 (the benchmark's own meter)

SEQ, BATCH, VOCAB, PADDED = 13, 3, 90, 96  # 39 tokens; rank 1 of TP=2 holds 42 real columns and 6 padding
CHUNK_BYTES = 4 * 5 * 48  # 5 rows of 48 fp32 columns: 8 chunks, the last one ragged


def _reference(logits_full: torch.Tensor, target: torch.Tensor, weights: torch.Tensor):
    """fp64 loss and gradient of the padded logits (zero on the padding) from F.cross_entropy."""
    ref_logits = logits_full[..., :VOCAB].double().requires_grad_()
    loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(target.shape)
    (loss * weights).sum().backward()
    grad = torch.cat([ref_logits.grad, torch.zeros(*target.shape, PADDED - VOCAB, dtype=torch.float64)], -1)
    return loss.detach(), grad


def _check(logits_full: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, tp: GroupHandle) -> None:
    local = logits_full.chunk(tp.size, -1)[tp.rank].clone().requires_grad_()
    tp.counters.reset()
    loss = vocab_parallel_cross_entropy(local, target, tp, vocab_size=VOCAB)
    assert tp.counters.calls("tp_allreduce") == (2 if tp.size > 1 else 0), "one MAX and one SUM per call"
    (loss * weights.float()).sum().backward()
    ref_loss, ref_grad = _reference(logits_full, target, weights)
    assert loss.dtype == torch.float32 and local.grad.dtype == local.dtype
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    # fp32 math throughout; a bf16 gradient is the fp64 one rounded to bf16 (relative step 2^-8).
    rtol, atol = (1e-6, 1e-8) if local.dtype == torch.float32 else (2 ** -8, 1e-6)
    torch.testing.assert_close(local.grad.double(), ref_grad.chunk(tp.size, -1)[tp.rank], rtol=rtol, atol=atol)
    assert torch.all(local.grad[..., VOCAB - tp.rank * local.shape[-1]:] == 0), "vocab padding gets no gradient"


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)  # every rank draws the same full tensors
    logits = (torch.randn(SEQ, BATCH, PADDED, generator=g) * 4).to(dtype)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    target[0, 0], target[1, 0] = VOCAB - 1, 0  # the last real column, and the first
    return logits, target, torch.rand(SEQ, BATCH, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_rank_matches_fp64_cross_entropy(monkeypatch, dtype):
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", CHUNK_BYTES)
    _check(*_inputs(dtype), GroupHandle.solo())


def _tp2_body(rank: int, world_size: int) -> None:
    cross_entropy.CHUNK_BYTES = CHUNK_BYTES
    tp = ParallelState(world_size=world_size, tensor_model_parallel_size=world_size).init_process_groups().tp_group
    for dtype in (torch.float32, torch.bfloat16):
        _check(*_inputs(dtype), tp)


@pytest.mark.distributed
def test_tp2_matches_fp64_cross_entropy():
    run_distributed(_tp2_body, world_size=2)


def test_fp32_temporaries_are_bounded_by_the_chunk_not_the_logits(monkeypatch):
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", CHUNK_BYTES)
    logits, target, weights = _inputs(torch.bfloat16)
    logits.requires_grad_()
    weights = weights.float()
    with LargestFloat32Output() as watch:
        (vocab_parallel_cross_entropy(logits, target, GroupHandle.solo(), vocab_size=VOCAB) * weights).sum().backward()
    assert logits.numel() * 4 > 8 * CHUNK_BYTES  # what an fp32 copy of the logits would take
    assert watch.largest <= CHUNK_BYTES, f"an fp32 temporary of {watch.largest} B > chunk {CHUNK_BYTES} B"
