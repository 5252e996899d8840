"""The saturation guard in practice: the forced-overflow test hook (megafp8.fp8.forced_overflow) clips one
layer's FP8 input exactly as documented; in a real training run (PP=2, torchrun) the guard moves that layer to
high precision, metrics.jsonl and the numerics report say so, the loss stays with the run that had no
overflow, and a resumed run keeps the switch. Without the guard the layer keeps saturating."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data_fixtures import REPO_ROOT, write_synthetic_dataset
from megafp8.fp8 import Fp8Linear, Fp8Recipe, SaturationGuard, collect_fp8_telemetry, enable_fp8_telemetry
from megafp8.fp8.forced_overflow import DEFAULT_FACTOR, ENV, ForcedOverflow
from megafp8.fp8.telemetry import saturation_threshold
from megafp8.training.megatron_flags import LLAMA_FLAGS


@pytest.mark.parametrize("spec, expected", [
    ("layers.1.mlp.linear_fc2@100", ForcedOverflow("layers.1.mlp.linear_fc2", 100, DEFAULT_FACTOR)),
    ("layers.0.self_attention.linear_qkv@3x16", ForcedOverflow("layers.0.self_attention.linear_qkv", 3, 16.0)),
    ("", None),
])
def test_hook_spec_parses(spec, expected):
    assert ForcedOverflow.from_env({ENV: spec}) == expected


@pytest.mark.parametrize("spec", ["layers.1", "layers.1@", "layers.1@5x1", "layers.1@5x-2", "@5"])
def test_bad_hook_spec_names_the_variable(spec):
    with pytest.raises(ValueError, match=ENV):
        ForcedOverflow.from_env({ENV: spec})


@pytest.mark.parametrize("recipe", [Fp8Recipe.tensorwise(), Fp8Recipe.delayed(amax_history_len=4)])
def test_forced_overflow_clips_the_input_above_amax_over_factor(recipe):
    """The input scale is multiplied by the factor: telemetry counts as saturated exactly the values above
    the clip level (fp64), the output follows the clipped input, and weights and grads stay finite."""
    torch.manual_seed(0)
    layer = Fp8Linear(64, 32, recipe=recipe)
    x = torch.randn(128, 64, dtype=torch.float64).float()
    layer(x).sum().backward()  # warms a delayed state up: its scale now comes from x's amax (history 4)
    layer.forced_overflow_factor = factor = 16.0
    enable_fp8_telemetry(layer)
    y = layer(x)
    y.sum().backward()

    scale = 448.0 / x.abs().max().double()  # E4M3 input (hybrid); both recipes: from x's own amax here
    clip_level = saturation_threshold(torch.float8_e4m3fn) / (scale * factor)
    expected = (x.double().abs() > clip_level).double().mean().item()
    stats = collect_fp8_telemetry(layer)
    assert expected > 0.5 and stats["fp8//input/saturated"] == pytest.approx(expected)
    assert stats["fp8//grad_output/saturated"] == 0  # only the input is forced

    clipped = x.double().clamp(-448.0 / (scale * factor), 448.0 / (scale * factor))
    reference = F.linear(clipped, layer.weight.double(), layer.bias.double())
    unclipped = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    error = (y.double() - reference).norm() / reference.norm()
    assert error < 0.1 < (unclipped - reference).norm() / reference.norm()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_forced_overflow_refuses_per_group_scaled_inputs():
    layer = Fp8Linear(128, 16, recipe=Fp8Recipe.rowwise())
    layer.forced_overflow_factor = 16.0
    with pytest.raises(ValueError, match=f"{ENV}.*per-tensor"):
        layer(torch.randn(8, 128))


def test_guard_switch_is_an_event_and_drops_the_layer_telemetry():
    layer = Fp8Linear(64, 32, recipe=Fp8Recipe.tensorwise())
    layer.forced_overflow_factor = 4096.0
    guard = SaturationGuard(patience=2)
    enable_fp8_telemetry(layer)
    for iteration in (1, 2):
        layer(torch.randn(16, 64)).sum().backward()
        messages = guard.check(layer, iteration)
    assert len(messages) == 1 and layer.guard_high_precision and layer.fp8_telemetry == {}
    [event] = guard.take_events()
    assert event["iteration"] == 2 and event["layer"] == "" and event["saturated"] > 0.5
    assert guard.take_events() == []
    layer(torch.randn(16, 64))  # high precision now: the hook has nothing to clip, no telemetry comes back
    assert collect_fp8_telemetry(layer) == {}


# ---- in a training run, as a user launches it --------------------------------------------------------------
TIMEOUT = 300
LAYER = "layers.0.mlp.linear_fc2"  # on pipeline stage 0: its switch must reach the last stage's metrics.jsonl
RUN = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--num-layers", "2",
       "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "4", "--seed", "7",
       "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
       "--fp8-amax-compute-algo", "max", "--pipeline-model-parallel-size", "2", "--distributed-timeout-minutes", "1"]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "synthetic_text_document")
    write_synthetic_dataset(prefix, [50] * 100, vocab_size=500)
    return prefix


def _pretrain(log_dir: Path, *flags: str, hook: str | None = None) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(ENV, None)
    if hook:
        env[ENV] = hook
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "megafp8.pretrain", *RUN, "--log-dir", str(log_dir), *flags],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


@pytest.mark.slow  # CI time: the guard through the entry runs by default in test_guard_param_gather and the parity test
def test_guard_in_practice_pp2_switch_logged_loss_kept_and_resumed(data_prefix, tmp_path):
    data = ["--data-path", data_prefix, "--train-iters", "12"]
    clean = _losses(_pretrain(tmp_path / "clean", *data))
    guarded = _pretrain(tmp_path / "guarded", *data, hook=f"{LAYER}@3")
    switches = [r for r in guarded if "fp8_guard_switch" in r]
    # Forced from iteration 3, over the 1% threshold for 3 consecutive steps: switched after iteration 5.
    assert [(r["iteration"], r["fp8_guard_switch"]) for r in switches] == [(5, LAYER)]
    assert switches[0]["saturated"] > 0.5
    losses = _losses(guarded)
    assert all(math.isfinite(v) for v in losses.values())
    assert abs(losses[12] / clean[12] - 1) < 0.02, (losses, clean)  # the loss stays with the clean run's

    # A resumed run keeps the layer in high precision: no new switch although the hook is still armed, and the
    # same losses as the uninterrupted run (a lost switch would clip the layer again and change them).
    _pretrain(tmp_path / "first_part", *data, "--save", str(tmp_path / "ckpt"), "--exit-interval", "8",
              hook=f"{LAYER}@3")
    resumed = _pretrain(tmp_path / "resumed", *data, "--load", str(tmp_path / "ckpt"), hook=f"{LAYER}@3")
    assert not [r for r in resumed if "fp8_guard_switch" in r]
    assert _losses(resumed)[12] == losses[12]

    # Without the guard the layer keeps clipping and no switch is logged.
    unguarded = _pretrain(tmp_path / "unguarded", *data, "--no-fp8-saturation-guard", hook=f"{LAYER}@3")
    assert not [r for r in unguarded if "fp8_guard_switch" in r]
    assert _losses(unguarded)[12] != losses[12]

    # The numerics report names the switch in its table, the verdict and the plots' run.
    report = tmp_path / "report"
    subprocess.run([sys.executable, "tools/fp8_report.py", str(tmp_path / "clean"), str(tmp_path / "guarded"),
                    "--output", str(report)], cwd=REPO_ROOT, check=True, capture_output=True, timeout=TIMEOUT)
    text = (report / "report.md").read_text()
    assert f"| guarded | 5 | {LAYER} |" in text
    assert f"the saturation guard moved {LAYER} to high precision at iteration 5" in text


def test_hook_naming_no_layer_fails_clearly(data_prefix, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", ENV: "layers.9.mlp.linear_fc2@1"}
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *RUN[:-4], "--data-path", data_prefix,
                             "--train-iters", "1"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=TIMEOUT, env=env)
    assert result.returncode != 0 and f"{ENV}: the model has no layer 'layers.9.mlp.linear_fc2'" in result.stderr


@pytest.mark.parametrize("spec, flags, message", [
    ("layers.0.mlp.linear_fc2@x", [], f"{ENV}='layers.0.mlp.linear_fc2@x': expected LAYER@ITERATION"),
    ("layers.0.mlp.linear_fc2@1", ["--fp8-recipe", "rowwise"], "--fp8-recipe delayed or tensorwise"),
])
def test_bad_hook_fails_before_training_with_one_line(spec, flags, message, data_prefix):
    env = {**os.environ, "OMP_NUM_THREADS": "1", ENV: spec}
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *RUN[:-4], *flags, "--data-path", data_prefix,
                             "--train-iters", "1"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=TIMEOUT, env=env)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
