"""No host sync in a non-logging iteration under several processes either (DP=2 on gloo, the training entry's
run() in each rank): the stop flag (SIGTERM, --exit-duration-in-mins) is agreed at log iterations only, so
iterations 2 and 3 of 4 (logging every 4) count no `aten::_local_scalar_dense` and no tolist/cpu/numpy; and
the time limit still stops both ranks at the same iteration (the next log iteration), saved by both."""
import os

import pytest
import torch

from data_fixtures import small_corpus, sp_model, text_prefix  # noqa: F401 (fixtures)
from distributed_testing import run_distributed
from test_training_host_sync import MODEL, _HostReads


def _train_in_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, _HostReads]:
    """The training entry's steps after its flag checks, in this already-initialized gloo rank, every host read
    counted per iteration."""
    from megafp8 import pretrain
    from megafp8.training import train as train_module
    from megafp8.training.run import run

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    args, errors, _ = pretrain.parse_and_check(argv, world_size)
    vocab_size, more_errors = pretrain.input_errors(args)
    assert not errors + more_errors, errors + more_errors
    reads = _HostReads()
    original_step = train_module.Trainer.train_step

    def train_step(self):
        reads.iteration = self.progress.iteration + 1
        return original_step(self)

    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}
    train_module.Trainer.train_step = train_step
    for name, method in originals.items():
        setattr(torch.Tensor, name, lambda self, *a, _m=method, _n=name, **k: (reads.count(_n), _m(self, *a, **k))[1])
    try:
        with reads:
            status = run(args, pretrain.parallel_state_from_args(args), pretrain.model_config_from_args(args, vocab_size))
    finally:
        train_module.Trainer.train_step = original_step
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    return status, reads


def _no_reads_body(rank: int, world_size: int, argv: list[str]) -> None:
    status, reads = _train_in_rank(rank, world_size, argv)
    assert status == 0
    assert reads.reads.get(2, []) == [] and reads.reads.get(3, []) == [], (rank, reads.reads)
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
