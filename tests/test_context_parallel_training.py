"""Context parallelism through the training entry (torchrun, gloo, fresh processes): CP 2 and CP 4 train like
CP 1 (fp32, per-step loss and grad norm), FP8 delayed scaling within its usual bound (also with FP8 param
gather and FP8 grad reduce), a CP-2 checkpoint resumes
at CP 1 and CP 4, and TP2 x CP2 x PP2 (8 processes, sequence parallel, ZeRO) trains like CP 1 and resumes
bit-exact, and PP2 x CP2 under a zero-bubble schedule trains like one process (fp32 and FP8)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_fixtures import REPO_ROOT, write_synthetic_dataset
from megafp8.training.megatron_flags import LLAMA_FLAGS

TIMEOUT = 300
MODEL = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
         "--distributed-timeout-minutes", "1", "--train-iters", "4"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
       "--fp8-amax-compute-algo", "max"]
ZERO = ["--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "synthetic_text_document")
    write_synthetic_dataset(prefix, [50] * 200, vocab_size=500)
    return prefix


def _train(nproc: int, data: str, log_dir: Path, *flags: str) -> dict[int, tuple[float, float]]:
    """{iteration: (lm loss, grad norm)} of one megafp8.pretrain launch."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megafp8.pretrain", *MODEL, "--data-path", data, "--log-dir", str(log_dir), *flags]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in records if "lm_loss" in r}


def _assert_close(actual: dict, expected: dict, rel: float) -> None:
    assert actual.keys() == expected.keys()
    for it in expected:
        for got, want in zip(actual[it], expected[it]):
            assert abs(got - want) <= rel * abs(want), (it, actual[it], expected[it])


@pytest.fixture(scope="module")
def cp1(data_prefix, tmp_path_factory) -> dict:
    return _train(1, data_prefix, tmp_path_factory.mktemp("cp1"), *ZERO)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_trains_like_cp1_fp32(data_prefix, tmp_path, cp1, cp):
    _assert_close(_train(cp, data_prefix, tmp_path, *ZERO, "--context-parallel-size", str(cp)), cp1, 1e-5)


# --fp8-grad-reduce at CP 2, DP 1: the FP8 reduce runs over the DP x CP group (at CP 1 it has nobody to reduce with).
FP8_EXTRAS = {"plain": [],
              "fp8-param-gather": [*ZERO, "--fp8-param-gather", "--overlap-param-gather", "--overlap-grad-reduce"],
              "fp8-grad-reduce": [*ZERO, "--fp8-grad-reduce", "--overlap-grad-reduce"]}


@pytest.mark.parametrize("extra", [e if e == "plain" else pytest.param(e, marks=pytest.mark.slow) for e in FP8_EXTRAS])
def test_context_parallel_fp8_delayed_within_bounds(data_prefix, tmp_path, extra):
    reference = _train(1, data_prefix, tmp_path / "cp1", *FP8, *FP8_EXTRAS[extra])
    cp2 = _train(2, data_prefix, tmp_path / "cp2", *FP8, *FP8_EXTRAS[extra], "--context-parallel-size", "2")
    # The amax group spans CP, so every cast uses CP 1's scale, except where a history is still empty (scale 1):
    # each CP rank's output gradients are CP x its share, so E5M2 rounds them differently there.
    _assert_close({it: v[:1] for it, v in cp2.items()}, {it: v[:1] for it, v in reference.items()}, 1e-3)
    _assert_close({it: v[1:] for it, v in cp2.items()}, {it: v[1:] for it, v in reference.items()}, 1e-2)


def test_cp2_checkpoint_loads_at_cp1_and_cp4(data_prefix, tmp_path, cp1):
    save = tmp_path / "ckpt"
    first = _train(2, data_prefix, tmp_path / "cp2", *ZERO, "--context-parallel-size", "2", "--save", str(save),
                   "--save-interval", "2", "--exit-interval", "2")
    _assert_close(first, {it: cp1[it] for it in (1, 2)}, 1e-5)
    for cp in (1, 4):  # CP ranks hold the same parameters; the ZeRO shards reshard from DP x CP 2 to 1 and 4
        resumed = _train(cp, data_prefix, tmp_path / f"resumed{cp}", *ZERO, "--context-parallel-size", str(cp),
                         "--load", str(save))
        _assert_close(resumed, {it: cp1[it] for it in (3, 4)}, 1e-5)


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "fp8"])
def test_cp2_with_a_zero_bubble_schedule_trains_like_cp1(data_prefix, tmp_path, precision):
    """PP2 x CP2 under zbv (the FP8 weight-gradient split in its W pass) against one process without CP or PP."""
    flags = [*ZERO, "--overlap-grad-reduce", "--num-layers", "4", "--global-batch-size", "8",
             *(FP8 if precision == "fp8" else [])]
    reference = _train(1, data_prefix, tmp_path / "reference", *flags)
    zbv = _train(4, data_prefix, tmp_path / "zbv", *flags, "--pipeline-model-parallel-size", "2",
                 "--context-parallel-size", "2", "--pipeline-schedule", "zbv")
    if precision == "fp32":
        _assert_close(zbv, reference, 1e-5)
    else:  # the bounds of test_context_parallel_fp8_delayed_within_bounds (measured 7e-5 and 2e-3)
        _assert_close({it: v[:1] for it, v in zbv.items()}, {it: v[:1] for it, v in reference.items()}, 1e-3)
        _assert_close({it: v[1:] for it, v in zbv.items()}, {it: v[1:] for it, v in reference.items()}, 1e-2)


def test_tp2_cp2_pp2_trains_like_cp1_and_resumes_bit_exact(data_prefix, tmp_path, cp1):
    layout = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--pipeline-model-parallel-size",
              "2", "--sequence-parallel", *ZERO, "--overlap-grad-reduce"]
    save = tmp_path / "ckpt"
    straight = _train(8, data_prefix, tmp_path / "straight", *layout, "--save", str(save), "--save-interval", "2")
    _assert_close(straight, cp1, 1e-5)
    (save / "latest_checkpointed_iteration.txt").write_text("2")  # resume from iteration 2 (Megatron's way)
    resumed = _train(8, data_prefix, tmp_path / "resumed", *layout, "--load", str(save))
    assert resumed == {it: straight[it] for it in (3, 4)}
