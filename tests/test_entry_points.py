"""The user-facing entry points as a new user meets them: the pretrain entry's FP8 self-check (with its
verdict), the GEMM benchmark's CPU mode, bad input as one message, the start-up banner, the --load and
checkpoint-mismatch messages, and the report tool's optional package."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megafp8.training.megatron_flags import LLAMA_FLAGS

REPO = Path(__file__).resolve().parents[1]


def test_pretrain_entry_runs_fp8_self_check():
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", "--fp8-self-check"], capture_output=True,
                            text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    for mode in ("tensorwise", "rowwise", "blockwise", "blockwise_1x128"):
        line = next(l for l in result.stdout.splitlines() if l.strip().startswith(mode + " "))
        assert float(line.split()[1]) >= 25.0 and line.split()[-1] == "OK", line
    assert result.stdout.splitlines()[-1] == "megafp8: FP8 self-check OK"


@pytest.mark.slow  # 40 s: a benchmark tool's smoke run (the GEMMs it times are tested against their twins)
def test_bench_gemm_quick_mode(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "tools/bench/bench_gemm.py", "--quick", "--json", str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    names = {r["name"] for r in rows if r["kind"] == "gemm"}
    assert {"megafp8 reference tensorwise", "megafp8 reference rowwise", "megafp8 reference blockwise"} <= names
    quant = {r["name"] for r in rows if r["kind"] == "quantize"}
    assert "cast+transpose block_1x128" in quant and "device copy" in quant
    assert all(r["ms"] > 0 for r in rows)
    assert "| M | N | K | GEMM | ms | TFLOP/s |" in result.stdout


def test_self_check_verdict_fails_below_the_bar(monkeypatch, capsys):
    from megafp8.training import self_check

    monkeypatch.setattr(self_check, "fp8_gemm_self_check", lambda: {"tensorwise": 28.0, "rowwise": 3.0})
    assert self_check.print_self_check() is False
    out = capsys.readouterr().out.splitlines()
    assert out[-3].split()[-1] == "OK" and out[-2].split()[-1] == "FAIL"
    assert out[-1] == "megafp8: FP8 self-check FAILED: rowwise"


def test_pretrain_entry_without_flags_names_what_is_missing():
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain"], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 2
    assert "--train-iters or --train-samples" in result.stderr and "--data-path" in result.stderr


# ---- what a new user hits: bad input is one line before any process group; a run says what it is ----------
SMALL_MODEL = [*LLAMA_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
               "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]


@pytest.fixture(scope="module")
def synthetic_prefix(tmp_path_factory):
    import numpy as np

    from megafp8.data.indexed_dataset import IndexedDatasetWriter

    prefix = str(tmp_path_factory.mktemp("data") / "synthetic_text_document")
    rng = np.random.default_rng(0)
    lengths = rng.integers(40, 200, 100).astype(np.int32)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(rng.integers(0, 500, int(lengths.sum())), lengths)
        writer.finalize()
    return prefix


def _pretrain(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megafp8.pretrain", *flags], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env=env)


@pytest.mark.parametrize("flags, messages", [
    (["--train-iters", "0"], ["--train-iters must be positive, got 0"]),
    (["--train-iters", "2", "--lr=-1e-3"], ["--lr must not be negative, got -0.001"]),
    (["--train-iters", "2", "--tensor-model-parallel-size", "3"],
     ["does not divide the world size (1)", "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (3)"]),
    (["--train-iters", "2", "TRUNCATED"], ["truncated, or written by an interrupted job?"]),
])
def test_bad_input_is_one_message_without_a_traceback(flags, messages, synthetic_prefix, tmp_path):
    data = synthetic_prefix
    if "TRUNCATED" in flags:  # a copy whose .idx lost its tail, as an interrupted copy would leave it
        flags = [f for f in flags if f != "TRUNCATED"]
        data = str(tmp_path / "cut_text_document")
        shutil.copy(synthetic_prefix + ".bin", data + ".bin")
        idx = Path(synthetic_prefix + ".idx").read_bytes()
        Path(data + ".idx").write_bytes(idx[:len(idx) // 2])
    result = _pretrain(*SMALL_MODEL, "--data-path", data, *flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("megafp8-pretrain: error:") == 1
    for message in messages:
        assert message in result.stderr, result.stderr
    if "--lr=-1e-3" in flags:
        assert "--min-lr" not in result.stderr  # the message blames the flag that is wrong


def _analytic_parameter_count(vocab: int, hidden: int, ffn: int, layers: int, multiple: int = 128) -> int:
    """Llama with tied embeddings and MHA: padded embedding + per layer (QKV, proj, SwiGLU, 2 norms) + final norm."""
    padded = -(-vocab // multiple) * multiple
    return padded * hidden + layers * (hidden * 3 * hidden + hidden * hidden + 3 * hidden * ffn + 2 * hidden) + hidden


def test_a_run_says_what_it_is_and_what_it_resumes(synthetic_prefix, tmp_path):
    save = tmp_path / "ckpt"
    run = [*SMALL_MODEL, "--data-path", synthetic_prefix, "--train-iters", "2", "--save", str(save),
           "--load", str(save), "--sequence-parallel", "--fp8-format", "hybrid", "--log-dir", str(tmp_path / "logs")]
    first = _pretrain(*run)
    assert first.returncode == 0, first.stderr[-3000:]
    # --sequence-parallel at TP 1: Megatron-LM's rule, one warning line
    assert first.stderr.count("warning: --sequence-parallel turned off") == 1, first.stderr
    # --load of a directory with no checkpoint yet: trains from scratch and says so
    assert f" no checkpoint in {save}: starting from iteration 0\n" in first.stdout
    banner = [line for line in first.stdout.splitlines() if line.startswith("megafp8: ")]
    assert banner[0] == "megafp8: layout TP 1 x CP 1 x PP 1 x DP 1 = 1 process"
    assert banner[1] == "megafp8: batch 4 samples per iteration = 2 micro-batches of 2 x DP 1; 128 tokens per iteration, 2 iterations"
    # 501 ids (NullTokenizer adds an end-of-document id), ffn Megatron-LM's default: 8/3 x 64 rounded down to 64 = 128
    assert banner[2] == f"megafp8: parameters {_analytic_parameter_count(501, 64, 128, 2):,}"
    # Megatron-LM's delayed-scaling defaults: a history of 1, the most recent amax
    assert banner[3].startswith("megafp8: precision FP8 hybrid delayed (amax history 1, most_recent)")
    assert banner[4] == f"megafp8: outputs checkpoints {save}, metrics {tmp_path / 'logs'}/metrics.jsonl"
    assert " | ETA: 0:00:00 |" in first.stdout and "| elapsed: " in first.stdout
    # a math flag changed on resume: the message names the CLI flag that allows it, which then works
    changed = [f if f != "1e-3" else "2e-3" for f in run]
    changed[changed.index("--train-iters") + 1] = "3"
    refused = _pretrain(*changed)
    assert refused.returncode == 2 and "--allow-changed-args lr" in refused.stderr, refused.stderr[-2000:]
    allowed = _pretrain(*changed, "--allow-changed-args", "lr")
    assert allowed.returncode == 0 and "(iteration 2)" in allowed.stdout, allowed.stderr[-2000:]


def test_fp8_report_without_matplotlib_is_one_line(monkeypatch, capsys):
    import importlib.util

    sys.path.insert(0, str(REPO / "tools"))
    import fp8_report

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    assert fp8_report.main(["run_dir", "--output", "out"]) == 2
    assert capsys.readouterr().err.strip() == ("fp8_report: error: the report's plots need the matplotlib package, "
                                              "which is not installed: pip install matplotlib (or pip install -e \".[report]\")")
