"""Suspicious steps (--rerun-mode, --check-for-nan-in-loss-and-grad, --check-for-spiky-loss) through the training
entry on real processes, faults injected by test hooks, nothing mocked: a transient NaN on one rank is named and
the run stops (exit 17) with the state before it saved, from which a resume continues the uninterrupted run bit for
bit; a poisoned sample is persistent, skipped on every rank exactly as a run that never re-ran skips it, and its
flight record names the sample (whose text tools/show_samples.py prints) and the first non-finite module; a loss
spike is re-run and reported by the rule (Megatron-Core's is_unexpectedly_large is the reference), or stops the run
with exit 16 when asked; report_stats measures determinism; tools/fp8_report.py lists the events."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_fixtures import REPO_ROOT, sp_model, small_corpus, text_prefix  # noqa: F401,F811 (fixtures)
from megafp8.training.arguments import parse_and_check
from megafp8.training.megatron_flags import LLAMA_FLAGS
from megafp8.training.result_checks import ResultChecks

MODEL = [*LLAMA_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--ffn-hidden-size", "96", "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--clip-grad", "1.0", "--eval-iters", "0",
         "--use-distributed-optimizer"]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]


def _pretrain(log_dir: Path, nproc: int, *flags: str, env: dict | None = None, expect: int = 0):
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    result = subprocess.run([sys.executable, *launch, "-m", "megafp8.pretrain", *MODEL, *flags, "--log-dir",
                             str(log_dir)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if expect and nproc > 1:  # torchrun exits 1 when a worker fails, and names each worker's exit code
        assert result.returncode == 1 and f"exitcode  : {expect}" in result.stderr, result.stderr[-3000:]
    else:
        assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _steps(log_dir: Path) -> dict[int, tuple]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"], r["skipped_iterations"]) for r in records
            if "grad_norm" in r}


def _record(log_dir: Path, iteration: int) -> dict:
    return json.loads((log_dir / "flight_records" / f"iter_{iteration:07d}.json").read_text())


@pytest.mark.distributed
def test_a_transient_nan_names_its_rank_and_the_resume_continues_the_run_bit_for_bit(tmp_path):
    layout = [*MOCK, "--pipeline-model-parallel-size", "2", "--log-interval", "2", "--train-iters", "6"]
    _pretrain(tmp_path / "uninterrupted", 4, *layout)
    # Rank 3 (last stage, DP rank 1) computes a NaN loss on step 3's first attempt only, as a flaky device would.
    # Step 3 does not log: its verdict reaches the host during step 4, which the re-run drops.
    faulted = _pretrain(tmp_path / "faulted", 4, *layout, "--save", str(tmp_path / "ckpt"),
                        env={"MEGAFP8_TEST_LOSS_FAULT": "nan:3@3:once"}, expect=17)
    line = next(x for x in faulted.stdout.splitlines() if x.startswith(" suspicious step at iteration 3"))
    assert "transient (the re-run passed): rank(s) 3 computed a different loss" in line and "exit 17" in line, line
    assert "iteration 3: transient nan on rank(s) 3: replace the node and resume" in faulted.stderr
    record = _record(tmp_path / "faulted", 3)
    assert (record["kind"], record["flaky_ranks"]) == ("nan", [3])
    assert record["attempts"][0]["nonfinite"] and not record["attempts"][1]["nonfinite"]
    assert {r["rank"]: r["coords"]["pp"] for r in record["ranks"]} == {0: 0, 1: 0, 2: 1, 3: 1}
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # before step 3
    _pretrain(tmp_path / "resumed", 4, *layout, "--load", str(tmp_path / "ckpt"))
    want, got = _steps(tmp_path / "uninterrupted"), _steps(tmp_path / "resumed")
    assert {i: got[i] for i in (4, 6)} == {i: want[i] for i in (4, 6)}


@pytest.mark.distributed
def test_a_poisoned_sample_is_persistent_skipped_as_ever_and_named(text_prefix, tmp_path):
    prefix, tokenizer = text_prefix
    data = ["--data-path", prefix, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer,
            "--train-iters", "6", "--log-interval", "3"]
    poison = {"MEGAFP8_TEST_POISON_SAMPLE": "37@layers.1.mlp"}  # in step 5's global batch (samples 32-39)
    checked = _pretrain(tmp_path / "checked", 2, *data, env=poison)
    _pretrain(tmp_path / "unchecked", 2, *data, "--rerun-mode", "disabled", env=poison)
    assert " suspicious step at iteration 5: nan" in checked.stdout
    record = _record(tmp_path / "checked", 5)
    assert (record["diagnosis"], record["action"]) == ("persistent (reproduced on re-run: numerics or data)", "skipped")
    where = record["first_nonfinite"]
    assert (where["module"], where["pass"], where["samples"], where["rank"]) == ("layers.1.mlp", "forward", [37], 0)
    assert record["samples"]["global_batch"] == [32, 40] and record["seed"] == 1234
    assert any(key.startswith("fp8/") for key in record["fp8_telemetry"]) is False  # an fp32 run has no FP8 layer
    # The re-run restored every state: the run equals one that skipped the step without looking twice.
    steps = _steps(tmp_path / "checked")
    assert steps == _steps(tmp_path / "unchecked") and steps[6][2] == 1

    shown = subprocess.run([sys.executable, "tools/show_samples.py",
                            str(tmp_path / "checked" / "flight_records" / "iter_0000005.json")], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    from megafp8.training.arguments import parse_args
    from megafp8.training.data_setup import build_datasets
    import sentencepiece

    train, _ = build_datasets(parse_args([*MODEL, *data]))
    text = sentencepiece.SentencePieceProcessor(model_file=tokenizer).decode(train[37]["tokens"].tolist())
    assert shown.stdout == f"=== sample 37 (33 tokens) ===\n{text}\n"

    report = subprocess.run([sys.executable, "tools/fp8_report.py", str(tmp_path / "checked"), "--output",
                             str(tmp_path / "report")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    table = (tmp_path / "report" / "report.md").read_text().split("## Suspicious steps", 1)[1]
    assert ("| checked | 5 | nan | persistent (reproduced on re-run: numerics or data) | skipped | layers.1.mlp "
            "(forward, rank 0) | 37 | `flight_records/iter_0000005.json` |") in table


@pytest.mark.distributed
def test_a_loss_spike_is_rerun_and_skipped_or_stops_the_run_when_asked(tmp_path):
    spike = ["--check-for-spiky-loss", "--spiky-loss-samples", "3", *MOCK, "--train-iters", "6", "--log-interval", "3"]
    env = {"MEGAFP8_TEST_LOSS_FAULT": "spike:1@5x1000"}  # rank 1's logits x1000 at step 5, every attempt
    result = _pretrain(tmp_path / "skip", 2, *spike, env=env)
    record = _record(tmp_path / "skip", 5)
    assert record["kind"] == "spike" and record["action"] == "skipped"
    assert record["spike_rule"].startswith("loss >= 10 x the largest |loss| of the first 3 steps (reference ")
    first, again = record["attempts"]
    assert first == again and first["spike"] and first["loss"] >= 10 * float(record["spike_rule"].split()[-4])
    assert _steps(tmp_path / "skip")[6][2] == 1 and " suspicious step at iteration 5: spike" in result.stdout

    stopped = _pretrain(tmp_path / "exit", 2, *spike, "--rerun-persistent-action", "exit", "--save",
                        str(tmp_path / "ckpt"), env=env, expect=16)
    assert "resume from the saved state on other nodes" in stopped.stderr
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


@pytest.mark.slow  # CI time: the other re-run tests run by default
def test_report_stats_runs_each_step_twice_and_logs_zero_differences_on_cpu(tmp_path):
    _pretrain(tmp_path / "plain", 1, *MOCK, "--train-iters", "4", "--log-interval", "2", "--rerun-mode", "disabled")
    result = _pretrain(tmp_path / "stats", 1, *MOCK, "--train-iters", "4", "--log-interval", "2",
                       "--rerun-mode", "report_stats")
    assert "re-run loss / grad norm rel. diff: 0.000E+00 / 0.000E+00" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "stats" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rerun_loss_rel_diff"], r["rerun_grad_norm_rel_diff"]) for r in records] == [(0.0, 0.0)] * 2
    assert _steps(tmp_path / "stats") == _steps(tmp_path / "plain")  # the second run of each step is applied


def test_the_spike_rule_is_megatron_cores(monkeypatch):
    """ResultChecks' spike verdicts on one rank equal Megatron-Core's RerunStateMachine.is_unexpectedly_large
    (10 x the max |loss| of the first N finite values) on a sequence with NaNs, infs and spikes."""
    rerun = pytest.importorskip("megatron.core.rerun_state_machine")
    theirs = rerun.RerunStateMachine()
    ours = ResultChecks(check_nan=True, check_spike=True, factor=10.0, samples=5, fp16=False,
                        device=torch.device("cpu"))
    losses = [3.0, float("nan"), 2.5, 4.0, float("inf"), 3.5, 1.0, 39.9, 40.0, 41.0, -45.0, 7.0, float("nan"), 400.0]
    for step, loss in enumerate(losses):
        value = torch.tensor(loss)
        verdict = ours.judge(value, torch.tensor(1.0, dtype=torch.float64))
        expected = theirs.is_unexpectedly_large(value, threshold=10, context="loss", num_samples=5)
        assert bool(verdict.spike) == expected, (step, loss)
        assert bool(verdict.nonfinite) == (not math.isfinite(loss)), step
        assert bool(verdict.suspicious) == (expected or not math.isfinite(loss)), step
    assert int(ours.seen) == 5 and float(ours.reference) == 4.0


@pytest.mark.parametrize("flags, error", [
    (["--spiky-loss-factor", "1"], "--spiky-loss-factor must be > 1, got 1.0"),
    (["--spiky-loss-samples", "0"], "--spiky-loss-samples must be >= 1, got 0"),
    (["--rerun-mode", "validate_results", "--enable-cuda-graph"], "--rerun-mode validate_results restores a host-side"),
])
def test_bad_rerun_flags_are_named(flags, error):
    _, errors, _ = parse_and_check([*MODEL, *MOCK, "--train-iters", "2", *flags])
    assert any(e.startswith(error) for e in errors), errors


def test_defaults_are_megatrons_except_under_cuda_graphs():
    args, errors, _ = parse_and_check([*MODEL, *MOCK, "--train-iters", "2"])
    assert (args.rerun_mode, args.check_for_nan_in_loss_and_grad, args.check_for_spiky_loss) == (
        "validate_results", True, False) and errors == []
    args, _, _ = parse_and_check([*MODEL, *MOCK, "--train-iters", "2", "--enable-cuda-graph"])
    assert args.rerun_mode == "disabled"
