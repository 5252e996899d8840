"""No host sync in a non-logging iteration under several processes either (DP=2 on gloo, the training entry's
run() in each rank): the stop flag (SIGTERM, --exit-duration-in-mins) is agreed at log iterations only, so
iterations 2 and 3 of 4 (logging every 4) count no `aten::_local_scalar_dense`, no tolist/cpu/numpy and no
host->device copy; and the time limit still stops both ranks at the same iteration (the next log iteration), saved by
both."""
import os

import pytest

from data_fixtures import small_corpus, sp_model, text_prefix  # noqa: F401 (fixtures)
from distributed_testing import run_distributed
from host_sync_counting import MODEL, HostReads


def _train_in_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, HostReads]:
    """The training entry's steps after its flag checks, in this already-initialized gloo rank, every host read
    and copy counted per iteration."""
    from megafp8 import pretrain
    from megafp8.training.run import run

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    args, errors, _ = pretrain.parse_and_check(argv, world_size)
    vocab_size, more_errors = pretrain.input_errors(args)
    assert not errors + more_errors, errors + more_errors
    reads = HostReads()
    undo = reads.install()
    try:
        with reads:
            status = run(args, pretrain.parallel_state_from_args(args), pretrain.model_config_from_args(args, vocab_size))
    finally:
        undo()
    return status, reads


def _no_reads_body(rank: int, world_size: int, argv: list[str]) -> None:
    status, reads = _train_in_rank(rank, world_size, argv)
    assert status == 0
    reads.assert_quiet_between_logs()
    assert reads.reads[4].count("_local_scalar_dense") >= 1  # the stop flag, agreed on the log iteration


@pytest.mark.distributed
def test_dp2_non_logging_iterations_read_nothing_from_the_device(text_prefix, tmp_path):
    prefix, tokenizer = text_prefix
    argv = [*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--log-dir", str(tmp_path / "logs")]
    run_distributed(_no_reads_body, world_size=2, args=(argv,), timeout_s=300)


def _time_limit_body(rank: int, world_size: int, argv: list[str], save: str) -> None:
    status, _ = _train_in_rank(rank, world_size, argv)
    assert status == 0
    # A limit of 0 minutes is over after the first iteration; the ranks agree on it at the first log iteration.
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "2", "stopped at the first log iteration (2), on both ranks"


@pytest.mark.distributed
def test_dp2_time_limit_stops_both_ranks_at_the_next_log_iteration(text_prefix, tmp_path):
    prefix, tokenizer = text_prefix
    save = str(tmp_path / "checkpoints")
    argv = [*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--log-interval", "2",
            "--exit-duration-in-mins", "0", "--save", save]
    run_distributed(_time_limit_body, world_size=2, args=(argv, save), timeout_s=300)
