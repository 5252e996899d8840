"""Block-scale histograms: with --log-fp8-telemetry a microscaled run writes, per FP4/MX tensor, the distribution of
log2 of its block scales to TensorBoard (what users ask TransformerEngine for when a block format misbehaves),
beside the saturated/flushed scalars; the values are the scales the quantizer used (checked against the quantizer)."""
import os
import subprocess
import sys

import pytest
import torch

from data_fixtures import REPO_ROOT
from megafp8.fp8 import Fp8Linear, Fp8Recipe
from megafp8.fp8.telemetry import collect_block_scale_histograms
from megafp8.training.megatron_flags import LLAMA_FLAGS
from megafp8_kernels.formats import E2M1, NVFP4_1X16
from megafp8_kernels.microscaling import quantize_microscaled


def test_histograms_are_the_quantizers_block_scales():
    layer = Fp8Linear(64, 32, bias=False, recipe=Fp8Recipe.named("nvfp4"))
    layer.telemetry_enabled = True
    x = torch.randn(16, 64) * torch.logspace(-2, 2, 16)[:, None]
    layer(x).sum().backward()
    histograms = collect_block_scale_histograms(torch.nn.Sequential(layer))
    assert set(histograms) == {f"fp8/0/{role}/log2_block_scale" for role in ("input", "weight", "grad_output")}
    expected = quantize_microscaled(x, E2M1, NVFP4_1X16)[0].block_scales_fp32().flatten()
    assert torch.equal(histograms["fp8/0/input/log2_block_scale"], torch.log2(expected[expected > 0]))
    assert histograms["fp8/0/input/log2_block_scale"].numel() == 16 * 64 // 16
    fp8 = Fp8Linear(64, 32, bias=False, recipe=Fp8Recipe.tensorwise())
    fp8.telemetry_enabled = True
    fp8(x).sum().backward()
    assert collect_block_scale_histograms(torch.nn.Sequential(fp8)) == {}  # one scale per tensor: no histogram


def test_the_training_entry_writes_them_to_tensorboard(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    command = [sys.executable, "-m", "megafp8.pretrain", *LLAMA_FLAGS, "--mock-data", "--tokenizer-type",
               "NullTokenizer", "--vocab-size", "200", "--num-layers", "2", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2",
               "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1", "--fp4-format", "e2m1",
               "--log-fp8-telemetry", "--tensorboard-dir", str(tmp_path / "tb")]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    events.Reload()
    tags = events.Tags()["histograms"]
    assert "fp8/layers.0.mlp.linear_fc1/grad_output/log2_block_scale" in tags, tags
    assert len([t for t in tags if t.endswith("log2_block_scale")]) == 2 * 4 * 3  # layers x linears x roles
    assert "fp8/layers.0.mlp.linear_fc1/input/saturated" in events.Tags()["scalars"]
