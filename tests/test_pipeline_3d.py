"""Full 3D: TP=2 x PP=2 x DP=2 (8 processes) with sequence parallelism and tied embeddings equals the
single-process run on the same global batch for 3 plain SGD steps (fp32: loss and every gradient within
1e-5 relative per step; DP gradients averaged by one all-reduce per parameter, the ZeRO issue replaces
it). Tied embeddings stay bit-identical across the first and last stage after every step."""
import pytest

from distributed_testing import run_distributed
from pipeline_testing import Case, assert_tied_embeddings_identical, run_case


def _body(rank: int, world_size: int) -> None:
    pipe = run_case(Case(pp=2, tp=2, sp=True, tie=True, steps=3), world_size,
                    step_hook=lambda pipe, reference, step, counted: assert_tied_embeddings_identical(pipe))
    assert_tied_embeddings_identical(pipe)  # after the last SGD step too
    assert pipe.parallel_state.dp_size == 2 and pipe.parallel_state.tp_size == 2


@pytest.mark.distributed
def test_tp2_pp2_dp2_sequence_parallel_matches_single_process():
    run_distributed(_body, world_size=8, timeout_s=900)
