"""Issue 36's seam check: a new format ("fp8 with per-64 blocks", tests/toy_per64_recipe.py) is one quantizer + twin +
recipe entry. The layer's three GEMMs take it without a branch of their own (checked against an fp64 computation from
the toy's own quantized operands), and the training entry runs it by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import toy_per64_recipe
from data_fixtures import REPO_ROOT, write_synthetic_dataset
from megafp8.fp8 import Fp8Linear, Fp8Recipe, registered_scaling
from megafp8.training.megatron_flags import LLAMA_FLAGS
from megafp8_kernels import has_kernel

@pytest.fixture(scope="module")
def recipe():
    """The toy recipe, registered for this module only: the registry is process-wide (--fp8-recipe's choices)."""
    with registered_scaling("toy_per64", toy_per64_recipe.RULE):
        yield Fp8Recipe(scaling="toy_per64", fp8_format="e4m3")


def _fp64(q) -> torch.Tensor:
    """A quantized operand's values in fp64, from its bytes and per-64 scales (the test's own dequantization)."""
    data, scale_inv = q.row_major()
    return data.double() * scale_inv.double().repeat_interleave(64, dim=1)[:, :data.shape[1]]


def test_the_recipe_hands_out_its_quantizer_for_every_role_and_gemm(recipe):
    for role, gemm in (("input", "fprop"), ("weight", "fprop"), ("weight", "dgrad"), ("grad_output", "wgrad")):
        quantizer = recipe.quantizer(role, gemm)
        assert isinstance(quantizer, toy_per64_recipe.Per64Quantizer)
        assert quantizer.layout == toy_per64_recipe.BLOCK_1X64
    assert not recipe.is_delayed and not recipe.fast_accum("fprop")
    q = recipe.quantizer("input").quantize(torch.randn(8, 128)).tensor
    assert not has_kernel(q, q)  # no FP8 kernel for 1x64: scaled_gemm runs the twin (never a guessed mode)


def test_the_linear_layer_runs_fprop_dgrad_and_wgrad_through_the_toy_quantizer(recipe):
    torch.manual_seed(0)
    layer = Fp8Linear(192, 96, bias=False, recipe=recipe)
    x = (torch.randn(32, 192) * torch.rand(1, 192) * 4).requires_grad_()
    y = layer(x)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)

    quantize = recipe.quantizer("input").quantize
    x_q, w_q = quantize(x.detach()).tensor, quantize(layer.weight.detach(), transpose=True).tensor
    dy_q = quantize(grad_y, transpose=True).tensor
    x_t = quantize(x.detach(), transpose=True).tensor.t()
    expected_y = _fp64(x_q) @ _fp64(w_q).t()
    expected_dx = _fp64(dy_q) @ _fp64(w_q.t()).t()
    expected_dw = _fp64(dy_q.t()) @ _fp64(x_t).t()
    # The op's fp32 products of the same FP8 operands: equal to fp64 up to fp32 accumulation.
    torch.testing.assert_close(y.double(), expected_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), expected_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), expected_dw, rtol=1e-5, atol=1e-4)
    # And the result is a real FP8 one: close to, not equal to, the high-precision product.
    exact = x.detach().double() @ layer.weight.detach().double().t()
    assert 0 < (y.double() - exact).abs().max() < 0.1 * exact.abs().max()


def _train(tmp_path, name: str, flags: list[str]) -> dict[int, float]:
    prefix = str(tmp_path / "data")
    if not os.path.exists(prefix + ".bin"):
        write_synthetic_dataset(prefix, [40] * 64, vocab_size=200)
    log_dir = tmp_path / name
    args = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-layers", "2",
            "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "0",
            "--train-iters", "4", "--eval-iters", "0", "--log-interval", "1", "--data-path", prefix,
            "--log-dir", str(log_dir), *flags]
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tests", "toy_per64_recipe.py"), *args],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(REPO_ROOT, "tests")})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


def test_the_training_entry_trains_with_the_registered_recipe_by_name(tmp_path):
    toy = _train(tmp_path, "toy", ["--fp8-format", "e4m3", "--fp8-recipe", "toy_per64"])
    fp32 = _train(tmp_path, "fp32", [])
    assert toy.keys() == fp32.keys() == {1, 2, 3, 4}
    for it in toy:  # FP8 with 64-element blocks tracks the fp32 run closely, and is not it
        assert abs(toy[it] - fp32[it]) <= 0.02 * fp32[it], (it, toy, fp32)
    assert toy != fp32  # (random tokens: the loss stays near ln(200); the match with fp32 is the check)
