"""--async-save through `megafp8.pretrain` (DP2, ZeRO, FP8 delayed scaling, the saturation guard): the checkpoints an
asynchronous run commits hold the same tensors, bit for bit, as a synchronous run's; a run that exits
(--exit-interval) with its save still in the background commits it first, and the resume reproduces the
uninterrupted run's losses exactly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from data_fixtures import REPO_ROOT
from megafp8.training.megatron_flags import LLAMA_FLAGS

FLAGS = [*LLAMA_FLAGS, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
         "--distributed-timeout-minutes", "2", "--use-distributed-optimizer", "--fp8-format", "hybrid",
         "--fp8-recipe", "delayed", "--train-iters", "4"]


def _train(tmp_path: Path, name: str, *flags: str) -> tuple[list[float], str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "megafp8.pretrain", *FLAGS, "--log-dir", str(tmp_path / name), *flags]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["lm_loss"] for r in records if "lm_loss" in r], result.stdout


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor entry of a checkpoint directory, whole (model, optimizer shards, FP8 scaling state)."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.items()
             if hasattr(m, "chunks")}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return state


@pytest.mark.distributed
def test_async_checkpoints_equal_sync_ones_and_an_exit_commits_the_pending_save(tmp_path):
    sync_losses, _ = _train(tmp_path, "sync", "--save", str(tmp_path / "sync_ckpt"), "--save-interval", "2")
    async_losses, out = _train(tmp_path, "async", "--save", str(tmp_path / "async_ckpt"), "--save-interval", "2",
                               "--async-save")
    assert async_losses == sync_losses
    assert "checkpoint at iteration 2 staged in host memory" in out and "written in the background" in out
    for iteration in (2, 4):
        name = f"iter_{iteration:07d}"
        sync, asynchronous = _tensors(tmp_path / "sync_ckpt" / name), _tensors(tmp_path / "async_ckpt" / name)
        assert sorted(sync) == sorted(asynchronous) and any(k.startswith("optimizer.") for k in sync)
        assert any("fp8_scaling" in k for k in sync)  # the amax histories and scales are in it
        for key in sync:
            assert torch.equal(sync[key], asynchronous[key]), (iteration, key)
    assert (tmp_path / "async_ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    # --exit-interval 2: the process exits right after staging; the save still commits first.
    _train(tmp_path, "first", "--save", str(tmp_path / "exit_ckpt"), "--async-save", "--exit-interval", "2")
    assert (tmp_path / "exit_ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed, _ = _train(tmp_path, "resumed", "--load", str(tmp_path / "exit_ckpt"), "--async-save")
    assert resumed == sync_losses[2:]
