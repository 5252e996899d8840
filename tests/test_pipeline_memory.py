"""1F1B keeps its activation-memory promise: pipeline stage r never holds the saved activations of more
than PP - r micro-batches (at most PP), measured from the tensors autograd saves
(megafp8.parallel.pipeline_memory), against one micro-batch's saved bytes on the same stage. With more
micro-batches than stages, a schedule that ran all forwards first would hold all of them."""
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import build_pipeline
from megafp8.parallel.pipeline_memory import SavedActivationMeter
from pipeline_testing import Case, config

MICROBATCHES = 8


def one_microbatch_saved_bytes(pipe) -> int:
    """Saved bytes of one micro-batch's forward (and loss) through this rank's single stage."""
    chunk, cfg = pipe.chunks[0], pipe.config
    with SavedActivationMeter(pipe.modules) as meter:
        if chunk.pre_process:
            out = chunk(torch.zeros(pipe.micro_batch_size, cfg.seq_length, dtype=torch.long))
        else:
            out = chunk(None, hidden_states=torch.randn(pipe._p2p_shape(), requires_grad=True))
        if chunk.post_process:  # the loss the schedule runs: target packs (labels, loss mask)
            out = pipe.microbatch_loss(out, torch.zeros(pipe.micro_batch_size, cfg.seq_length, 2, dtype=torch.float64))
        saved = meter.live_bytes
        del out
    return saved


def _body(rank: int, world_size: int) -> None:
    case = Case(pp=world_size, layers=2 * world_size, microbatches=MICROBATCHES)
    cfg = config(case)
    ps = ParallelState(world_size=world_size, pipeline_model_parallel_size=world_size).init_process_groups()
    pipe = build_pipeline(cfg, ps, micro_batch_size=1, num_microbatches=MICROBATCHES)
    per_microbatch = one_microbatch_saved_bytes(pipe)
    ids = torch.randint(0, cfg.vocab_size, (MICROBATCHES, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    with SavedActivationMeter(pipe.modules) as meter:
        pipe.step(ids, ids.roll(-1, dims=1))
    in_flight = world_size - ps.coords.pp  # 1F1B: warm-up forwards + 1
    assert meter.live_bytes == 0, "every saved activation is released by the end of the step"
    assert per_microbatch > 0
    # 1% slack: the pipeline's micro-batch token ids are views of the whole batch (storage charged whole).
    assert meter.peak_bytes <= in_flight * per_microbatch * 1.01, (rank, meter.peak_bytes, per_microbatch)
    assert meter.peak_bytes >= (in_flight - 0.5) * per_microbatch, "the schedule fills the pipeline"


@pytest.mark.distributed
def test_1f1b_holds_at_most_pp_microbatches_per_stage():
    run_distributed(_body, world_size=4, timeout_s=600)
