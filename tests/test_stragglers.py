"""Stragglers: a rank slowed at every iteration (the test hook) shows as the one rank working longer than the others
outside collective waits: its work time in metrics.jsonl and the straggler line name it; the rule on hand numbers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from data_fixtures import REPO_ROOT
from megafp8.training.hang_watchdog import TEST_HANG_ENV
from megafp8.training.megatron_flags import LLAMA_FLAGS
from megafp8.training.stragglers import straggler_line


@pytest.mark.distributed
def test_a_slow_rank_is_named_as_the_straggler(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "megafp8.pretrain", *LLAMA_FLAGS, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
               "200", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--eval-iters", "0",
               "--log-interval", "2", "--use-distributed-optimizer", "--log-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", TEST_HANG_ENV: "1@*:0.5"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    work = [r["rank_work_ms"] for r in records if "lm_loss" in r]
    assert len(work) == 2 and all(len(w) == 2 and w[1] > w[0] + 400 for w in work), work  # rank 1 sleeps 500 ms
    lines = [line for line in result.stdout.splitlines() if line.startswith(" straggler:")]
    assert len(lines) == 2 and all(" rank 1 works " in line for line in lines), result.stdout[-2000:]
    assert "over iterations 1-2" in lines[0] and "over iterations 3-4" in lines[1]


def test_the_straggler_rule():
    assert straggler_line([100.0, 100.0, 100.0, 119.0], 1, 10) is None  # within 1.2x of the median
    line = straggler_line([100.0, 100.0, 130.0, 100.0], 11, 20)
    assert line.startswith("straggler: rank 2 works 1.30x the median rank") and "over iterations 11-20" in line
    assert straggler_line([50.0], 1, 1) is None
