"""The hang watchdog (--hang-timeout-minutes) on a real 4-process run: one rank stalls inside a step (the test hook),
every rank writes its stacks and collectives, and rank 0 names the stalled rank long before the distributed timeout;
the who-waits-on-whom rule on hand-made reports; the flag's checks."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from data_fixtures import REPO_ROOT
from megafp8.training.arguments import parse_and_check
from megafp8.training.hang_watchdog import TEST_HANG_ENV, InjectedStall, who_waits_on_whom
from megafp8.training.megatron_flags import LLAMA_FLAGS


@pytest.mark.distributed
def test_a_stalled_rank_is_named_with_every_ranks_stacks_before_the_timeout(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
               "megafp8.pretrain", *LLAMA_FLAGS, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
               "200", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "4", "--eval-iters", "0",
               "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
               "--hang-timeout-minutes", "0.05", "--distributed-timeout-minutes", "1", "--log-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", TEST_HANG_ENV: "3@3:12"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]  # a stall, not a hang: it goes on
    line = next(line for line in result.stdout.splitlines() if line.startswith(" hang:"))
    assert line.startswith(" hang: iteration 3 has run ") and "--hang-timeout-minutes 0.05" in line
    # Rank 3's TP peer (rank 2) waits in a TP collective for it, rank 1 (its DP peer) in the gradient reduction, and
    # rank 0 for rank 2: every chain ends at rank 3.
    assert "ranks 3 hold up the others" in line and re.search(r"for ranks 3, which have not entered it", line), line
    assert "no report from" not in line
    joined = tmp_path / "hang_iter0000003.txt"
    text = joined.read_text()
    for rank in range(4):
        section = text.split(f"===== rank {rank} =====\n", 1)[1].split("=====", 1)[0]
        assert '"iteration": 3' in section and "File " in section, rank  # its facts and its stacks
    assert "maybe_sleep" in text.split("===== rank 3 =====", 1)[1]  # the stalled rank's stack shows where it is
    assert f"every stack: {joined}" in line


def _fact(kind: str, ranks: list[int], number: int, entered: dict[str, int]) -> dict:
    return dict(last_collective=dict(kind=kind, ranks=ranks, bytes=8, number=number), entered=entered)


def test_the_members_behind_on_a_group_are_the_ones_waited_on():
    group = "0,1,2,3"
    facts = {0: _fact("dp_grad_reduce", [0, 1, 2, 3], 7, {group: 7}),
             1: _fact("dp_grad_reduce", [0, 1, 2, 3], 6, {group: 6}),  # finished step 6's, never entered step 7's
             2: _fact("dp_grad_reduce", [0, 1, 2, 3], 7, {group: 7}),
             3: _fact("tp_allreduce", [2, 3], 9, {group: 7, "2,3": 9})}
    facts[2]["entered"]["2,3"] = 8
    assert who_waits_on_whom(facts) == (
        "ranks 1 hold up the others (every wait leads to them, and they wait in no collective): ranks 0, 2 wait in "
        "dp_grad_reduce over ranks 0,1,2,3 for ranks 1, which have not entered it; ranks 3 wait in tp_allreduce over "
        "ranks 2,3 for ranks 2, which have not entered it")
    level = {r: _fact("dp_grad_reduce", [0, 1], 3, {"0,1": 3}) for r in (0, 1)}
    assert who_waits_on_whom(level).startswith("no rank waits for another")


def test_the_test_hook_and_the_flag_are_checked():
    with pytest.raises(ValueError, match="expected RANK@ITERATION:SECONDS"):
        os.environ[TEST_HANG_ENV] = "1@x"
        try:
            InjectedStall.from_env()
        finally:
            del os.environ[TEST_HANG_ENV]
    _, errors, _ = parse_and_check(["--hang-timeout-minutes", "10", "--distributed-timeout-minutes", "10"])
    assert any("--hang-timeout-minutes (10) must be below --distributed-timeout-minutes (10)" in e for e in errors)
    _, errors, _ = parse_and_check(["--hang-timeout-minutes", "-1"])
    assert any("--hang-timeout-minutes must be >= 0" in e for e in errors)
