"""Non-persistent local checkpoints (--non-persistent-ckpt-type local) through the training entry on 2 real
processes, FP8 delayed scaling with --fp8-param-gather (weights without high-precision storage): a run killed
(-9) after a local save at iteration 6 resumes from it, newer than the persistent checkpoint of iteration 4, and
continues the uninterrupted run bit for bit; with one rank's file missing every rank falls back to the persistent
checkpoint, says so in one line, and continues bit for bit from there. The file checks (truncated, other layout)
and the flags' checks."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from data_fixtures import REPO_ROOT
from megafp8.checkpoint.local_checkpoint import check_local, complete_iterations, load_local, save_local
from megafp8.training.arguments import parse_and_check
from megafp8.training.megatron_flags import LLAMA_FLAGS

RUN = [*LLAMA_FLAGS, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-layers", "2",
       "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
       "--clip-grad", "1.0", "--eval-iters", "0", "--use-distributed-optimizer", "--train-iters", "8",
       "--log-interval", "1", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
       "--fp8-amax-compute-algo", "max", "--fp8-param-gather", "--bf16"]
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "megafp8.pretrain"]


def _saves(root: Path, kind: str = "local") -> list[str]:
    where = ["--non-persistent-local-ckpt-dir", str(root / "local")] if kind == "local" else []
    return ["--save", str(root / "ckpt"), "--save-interval", "4", "--non-persistent-save-interval", "3",
            "--non-persistent-ckpt-type", kind, *where]


def _run(log_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    result = subprocess.run([*LAUNCH, *RUN, *flags, "--log-dir", str(log_dir)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _steps(log_dir: Path) -> dict[int, tuple]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in records if "grad_norm" in r}


def _killed_after_local_save(root: Path, kind: str = "local") -> None:
    """The run dies (kill -9 of every process) right after its non-persistent save at iteration 6: rank 0 stalls
    in iteration 7 (the hang test hook) so the kill lands there."""
    saved = f"saved {kind} checkpoint at iteration 6" if kind == "local" else "saved checkpoint at iteration 6"
    process = subprocess.Popen([*LAUNCH, *RUN, *_saves(root, kind), "--log-dir", str(root / "killed")],
                               cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "MEGAFP8_TEST_HANG": "0@7:120"})
    seen = []
    try:
        deadline = time.monotonic() + 300
        for line in process.stdout:
            seen.append(line)
            if saved in line or time.monotonic() > deadline:
                break
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert any(saved in line for line in seen), "".join(seen[-40:])


@pytest.mark.distributed
def test_a_killed_run_resumes_from_its_newer_local_checkpoint_or_falls_back(tmp_path):
    _run(tmp_path / "uninterrupted")
    want = _steps(tmp_path / "uninterrupted")
    _killed_after_local_save(tmp_path)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert [complete_iterations(tmp_path / "local", rank) for rank in (0, 1)] == [[6], [6]]  # 3 was pruned
    fallback = tmp_path / "fallback"
    for name in ("ckpt", "local"):
        shutil.copytree(tmp_path / name, fallback / name)

    resumed = _run(tmp_path / "resumed", *_saves(tmp_path), "--load", str(tmp_path / "ckpt"))
    assert (" resuming from the local non-persistent checkpoint of iteration 6 (complete on every rank; newer than "
            "the persistent iteration 4)") in resumed.stdout
    assert _steps(tmp_path / "resumed") == {i: want[i] for i in (7, 8)}

    (fallback / "local" / "iter_0000006" / "rank_00001.pt").unlink()
    fell_back = _run(fallback / "logs", *_saves(fallback), "--load", str(fallback / "ckpt"))
    line = next(x for x in fell_back.stdout.splitlines() if "non-persistent checkpoints:" in x)
    assert line.startswith(" local non-persistent checkpoints: iteration 6 cannot be loaded: ") and \
        "rank_00001.pt is missing" in line and \
        line.endswith("resuming from the persistent checkpoint of iteration 4"), line
    assert _steps(fallback / "logs") == {i: want[i] for i in (5, 6, 7, 8)}


@pytest.mark.slow  # the global kind writes the persistent format, tested everywhere; its resume choice is local's
@pytest.mark.distributed
def test_a_global_non_persistent_checkpoint_newer_than_the_persistent_one_is_resumed(tmp_path):
    """--non-persistent-ckpt-type global: the persistent format under --save/non_persistent, one kept."""
    _killed_after_local_save(tmp_path, "global")
    assert (tmp_path / "ckpt" / "non_persistent" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert sorted(p.name for p in (tmp_path / "ckpt" / "non_persistent").glob("iter_*")) == ["iter_0000006"]
    resumed = _run(tmp_path / "resumed", *_saves(tmp_path, "global"), "--load", str(tmp_path / "ckpt"))
    assert (" resuming from the global non-persistent checkpoint of iteration 6 (its newest; newer than the "
            "persistent iteration 4)") in resumed.stdout
    _run(tmp_path / "uninterrupted")
    assert _steps(tmp_path / "resumed") == {i: _steps(tmp_path / "uninterrupted")[i] for i in (7, 8)}


def test_a_truncated_or_foreign_layout_file_is_named(tmp_path):
    layout = {"tp": 0, "dp": 1, "pp": 0, "cp": 0, "world_size": 2, "sizes": [1, 1, 1, 2, 1]}
    state = {"optimizer": [torch.arange(1000.0)], "progress": {"iteration": 5}}
    path = save_local(tmp_path, 5, 1, state, layout)
    assert check_local(tmp_path, 5, 1, layout) is None
    assert torch.equal(load_local(tmp_path, 5, 1)["optimizer"][0], torch.arange(1000.0))
    assert "saved at layout" in check_local(tmp_path, 5, 1, {**layout, "sizes": [2, 1, 1, 1, 1]})
    save_local(tmp_path, 7, 1, state, layout)
    assert complete_iterations(tmp_path, 1) == [7] and not path.exists()  # the older one is gone
    newer = tmp_path / "iter_0000007" / "rank_00001.pt"
    newer.write_bytes(newer.read_bytes()[:-10])
    assert "rank_00001.pt is truncated or overwritten" in check_local(tmp_path, 7, 1, layout)
    newer.write_bytes(b"x" * 10 + newer.read_bytes()[10:] + b"0123456789")  # the same size, other bytes
    assert check_local(tmp_path, 7, 1, layout).endswith(
        "rank_00001.pt is corrupt: its SHA-256 differs from the manifest's")
    assert "rank 0 has no complete file for iteration 7" in check_local(tmp_path, 7, 0, layout)


@pytest.mark.parametrize("flags, error", [
    (["--non-persistent-save-interval", "2"], "--non-persistent-save-interval needs --non-persistent-ckpt-type"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local", "--save", "x"],
     "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir"),
    (["--non-persistent-ckpt-type", "in_memory"], "--non-persistent-ckpt-type in_memory is not built"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"],
     "--non-persistent-save-interval needs --save"),
])
def test_bad_non_persistent_flags_are_named(flags, error):
    _, errors, _ = parse_and_check([*RUN, *flags])
    assert any(e.startswith(error) for e in errors), errors
