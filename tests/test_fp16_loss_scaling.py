"""--fp16's loss scaling (issue 32): the device-side dynamic scaler step by step against Megatron-Core's
DynamicGradScaler (a test peer), and through the training entry: a power-of-two scale changes no bit of the
losses and grad norms (the optimizer unscales before the norm, the clip and the update), an injected non-finite
step is skipped on every DP rank and moves the scale as Megatron-Core's scaler does, and a resume continues the
scale and its trackers bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from unittest import mock

import pytest
import torch

from data_fixtures import REPO_ROOT
from megafp8.optim.loss_scaler import DynamicLossScaler, LossScaler
from megafp8.training.megatron_flags import LLAMA_FLAGS

grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")

MODEL = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--clip-grad", "1.0", "--eval-iters", "0", "--log-interval", "1", "--mock-data"]
SCALER = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2", "--hysteresis", "1"]


def _megatron_core(scaler_class, **kwargs):
    """Megatron-Core's scaler with its 'cuda' tensors made on the CPU; its code runs unchanged otherwise."""
    make = torch.tensor
    with mock.patch.object(torch, "tensor", lambda *args, device=None, **kw: make(*args, **kw)):
        return scaler_class(**kwargs)


def _megatron_dynamic(initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int):
    return _megatron_core(grad_scaler.DynamicGradScaler, initial_scale=initial_scale, min_scale=min_scale,
                          growth_factor=2.0, backoff_factor=0.5, growth_interval=growth_interval,
                          hysteresis=hysteresis)


def test_dynamic_scaler_follows_megatron_core_step_by_step():
    found = torch.rand(200, generator=torch.Generator().manual_seed(0)) < 0.3
    ours = DynamicLossScaler(initial_scale=2.0**10, min_scale=4.0, growth_interval=3, hysteresis=2)
    theirs = _megatron_dynamic(initial_scale=2.0**10, min_scale=4.0, growth_interval=3, hysteresis=2)
    scales = set()
    for step, inf in enumerate(found.tolist()):
        ours.update(torch.tensor(inf))
        theirs.update(inf)
        assert (ours.scale.item(), ours.growth_tracker.item(), ours.hysteresis_tracker.item()) == (
            theirs.scale.item(), theirs._growth_tracker, theirs._hysteresis_tracker), step
        scales.add(ours.scale.item())
    assert min(scales) == 4.0 and max(scales) > 2.0**10  # the floor and growth were both reached
    assert ours.inverse().item() == theirs.inv_scale.item()
    constant = LossScaler(8.0)
    constant.update(torch.tensor(True))
    assert constant.scale.item() == _megatron_core(grad_scaler.ConstantGradScaler, initial_scale=8.0).scale.item()


def _pretrain(tmp_path: Path, name: str, nproc: int, *flags: str, **env: str) -> tuple[str, list[dict]]:
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    result = subprocess.run([sys.executable, *launch, "-m", "megafp8.pretrain", *MODEL, *flags,
                             "--log-dir", str(tmp_path / name)], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result.stdout, [r for r in records if "lm_loss" in r]


def test_power_of_two_loss_scale_changes_no_bit_of_the_run(tmp_path):
    """On CPU --fp16 computes in fp32 (DESIGN.md), so only the scaling differs: x 2^32 and back is exact."""
    _, plain = _pretrain(tmp_path, "plain", 1, "--train-iters", "4")
    out, scaled = _pretrain(tmp_path, "fp16", 1, "--train-iters", "4", "--fp16")
    assert "dynamic loss scale from 4294967296 (window 1000, hysteresis 2, min 1)" in out
    assert [(r["lm_loss"], r["grad_norm"]) for r in scaled] == [(r["lm_loss"], r["grad_norm"]) for r in plain]
    assert {r["loss_scale"] for r in scaled} == {2.0**32} and all("loss_scale" not in r for r in plain)


def test_injected_overflow_is_skipped_on_every_rank_and_the_scale_moves_as_megatron_core(tmp_path):
    out, records = _pretrain(tmp_path, "run", 2, "--train-iters", "6", *SCALER, MEGAFP8_INJECT_NAN_AT_ITERATION="2")
    theirs = _megatron_dynamic(initial_scale=1024.0, min_scale=1.0, growth_interval=2, hysteresis=1)
    expected = []
    for iteration in range(1, 7):
        theirs.update(iteration == 2)
        expected.append(theirs.scale.item())
    assert [r["loss_scale"] for r in records] == expected == [1024, 512, 512, 1024, 1024, 2048]
    assert [r["skipped_iterations"] for r in records] == [0, 1, 1, 1, 1, 1]  # the finite flag is global: DP2 agrees
    line = next(line for line in out.splitlines() if "iteration        2/" in line)
    assert "| loss scale: 512.0 | grad norm:" in line
    # Stopped after iteration 3 and resumed in fresh processes: the scale (512) and its growth count (1) continue.
    _pretrain(tmp_path, "first", 2, "--train-iters", "6", *SCALER, "--save", str(tmp_path / "ckpt"), "--exit-interval",
              "3", MEGAFP8_INJECT_NAN_AT_ITERATION="2")
    _, resumed = _pretrain(tmp_path, "resumed", 2, "--train-iters", "6", *SCALER, "--load", str(tmp_path / "ckpt"))
    assert [(r["iteration"], r["lm_loss"], r["grad_norm"], r["loss_scale"]) for r in resumed] == [
        (r["iteration"], r["lm_loss"], r["grad_norm"], r["loss_scale"]) for r in records[3:]]
