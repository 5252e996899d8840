"""Validation resumes where it stopped (Megatron-LM's consumed_valid_samples): a resumed run evaluates on the
samples the uninterrupted run would, also once the validation split has wrapped around."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from data_fixtures import REPO_ROOT, write_synthetic_dataset
from megafp8.training.data_setup import batches
from megafp8.training.megatron_flags import LLAMA_FLAGS
from megafp8.training.train import TrainProgress


class _Numbered(torch.utils.data.Dataset):
    """Sample i is the tokens [i]: the stream shows which samples were read."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        return {"tokens": torch.tensor([i])}


def _dp(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(data_parallel_rank=rank, dp_size=size)


def _global_batches(dataset, consumed: int, micro_batch: int, dp_size: int, count: int) -> list[list[int]]:
    """`count` global micro-batches, each the concatenation of every DP rank's micro-batch, in rank order."""
    args = argparse.Namespace(micro_batch_size=micro_batch)
    ranks = [batches(dataset, consumed, args, _dp(r, dp_size), cycle=True) for r in range(dp_size)]
    return [torch.cat([next(r) for r in ranks]).flatten().tolist() for _ in range(count)]


def test_a_cycling_iterator_resumed_at_k_continues_the_uninterrupted_stream():
    dataset = _Numbered(23)  # 23 = 5 global micro-batches of 4 and 3 left over: each pass drops the last 3
    micro_batch, dp = 2, 2
    straight = _global_batches(dataset, 0, micro_batch, dp, 30)  # six passes
    assert straight[5] == [0, 1, 2, 3]  # the pass wrapped after 20 samples (the last 3 are never read)
    for k in (0, 4, 16, 20, 28, 64):  # before, at and after the wrap; many passes on
        assert _global_batches(dataset, k, micro_batch, dp, 6) == straight[k // 4: k // 4 + 6], k


def test_a_validation_split_smaller_than_a_global_micro_batch_is_an_error_not_a_hang():
    with pytest.raises(ValueError, match="--micro-batch-size 2 x 2"):
        batches(_Numbered(3), 0, argparse.Namespace(micro_batch_size=2), _dp(0, 2), cycle=True)


def test_a_checkpoint_from_before_the_counter_loads_with_validation_at_0():
    saved = {"iteration": 6, "consumed_samples": 24, "skipped_iterations": 0, "nan_iterations": 0}
    assert TrainProgress(**saved).consumed_valid_samples == 0  # how megafp8.training.run rebuilds the progress


# ---- end to end: the training entry, interrupted with --exit-interval and resumed --------------------------------
FLAGS = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--num-layers", "1",
         "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "4",
         "--global-batch-size", "4", "--lr", "1e-3", "--split", "90,10,0", "--train-iters", "10",
         "--eval-interval", "2", "--eval-iters", "1"]


def _pretrain(*flags: str) -> None:
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *FLAGS, *flags], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def _validation(log_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["val_lm_loss"] for r in records if "val_lm_loss" in r}


def test_a_resumed_run_validates_on_the_samples_of_the_uninterrupted_run(tmp_path):
    # An unweighted blend's validation split is one epoch of each member: 6 + 4 samples of 32 tokens here, so each
    # pass reads 2 global batches of 4 and evaluations alternate between them; the resume at iteration 6 (3
    # evaluations, 12 samples read) must continue with the second, where restarting at sample 0 gives the first.
    write_synthetic_dataset(str(tmp_path / "a"), [50] * 40, vocab_size=500, seed=0)
    write_synthetic_dataset(str(tmp_path / "b"), [50] * 30, vocab_size=500, seed=1)
    data = ["--data-path", str(tmp_path / "a"), str(tmp_path / "b")]
    _pretrain(*data, "--log-dir", str(tmp_path / "straight"))
    _pretrain(*data, "--save", str(tmp_path / "checkpoints"), "--exit-interval", "6", "--log-dir", str(tmp_path / "first"))
    _pretrain(*data, "--load", str(tmp_path / "checkpoints"), "--log-dir", str(tmp_path / "resumed"))
    straight = _validation(tmp_path / "straight")
    assert sorted(straight) == [2, 4, 6, 8, 10] and straight[2] != straight[4]  # the two halves of the split differ
    assert _validation(tmp_path / "first") == {i: straight[i] for i in (2, 4, 6)}
    resumed = _validation(tmp_path / "resumed")
    assert sorted(resumed) == [8, 10]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-6, abs=0), iteration
