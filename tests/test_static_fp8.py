"""μnit Scaling's static FP8 casts (`--fp8-recipe static`, issue 32) on its unit-scaled model (`--unit-scaling
--residual-tau`): every cast uses its fixed scale (1, the gradients' --fp8-static-grad-scale), so a training step under
TP=2 + SP runs no amax collective (counted; current tensorwise scaling runs them) and the layers keep no scaling state
(nothing to checkpoint); the TP run matches the single-process model; through the training entry the μS model with
static casts tracks its fp32 run, a resume is bit-exact, and the misuses are refused in one line."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from convert_testing import convert
from data_fixtures import REPO_ROOT, write_synthetic_dataset
from distributed_testing import run_distributed
from megafp8.fp8 import Fp8Recipe
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megafp8.training.arguments import parse_and_check
from megafp8.training.megatron_flags import LLAMA_FLAGS

STATIC = Fp8Recipe.named("static", fp8_format="hybrid", static_grad_scale=256.0)
MUS = dict(unit_scaling=True, residual_tau=0.2, post_norm=True, pre_norm=False)


def _config() -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=16,
                       vocab_size=64, make_vocab_size_divisible_by=2, seed=3, **MUS)


def _step(model, cfg, ps) -> torch.Tensor:
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(5))
    loss = model(ids, ids)
    loss.mean().backward()
    return loss.detach()


def _static_body(rank: int, world_size: int) -> None:
    cfg = _config()
    reference = GPTModel(cfg, ParallelState().init_process_groups(), fp8_recipe=STATIC)
    ref_loss = _step(reference, cfg, None)
    for recipe, amax_collectives in ((STATIC, False), (Fp8Recipe.tensorwise(fp8_format="hybrid"), True)):
        ps = ParallelState(world_size=world_size, tensor_model_parallel_size=world_size,
                           sequence_parallel=True).init_process_groups()
        model = GPTModel(cfg, ps, fp8_recipe=recipe)  # from scratch: the layout-invariant init
        linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        assert all(m.output_multiplier == 1 / math.sqrt(m.input_size) for m in linears)
        ps.comm.reset()
        loss = _step(model, cfg, ps)
        assert (ps.comm["amax_reduce"] > 0) == amax_collectives, (recipe.scaling, ps.comm["amax_reduce"])
        if recipe is STATIC:
            assert not any(getattr(m, "fp8_scaling", {}) for m in model.modules()), "no scaling state to keep"
            weight = linears[0].fp8_weight(recipe, linears[0].weight)
            assert torch.equal(weight.scale_inv, torch.ones(()))
            # The same model at TP=1 (same init, same static scales): equal up to the TP reduction order.
            assert (loss - ref_loss).abs().max() <= 1e-3 * ref_loss.abs().max(), (loss, ref_loss)


@pytest.mark.distributed
def test_static_casts_run_no_amax_collective_and_keep_no_state_under_tp_sp():
    run_distributed(_static_body, world_size=2)


MODEL = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--num-layers", "4",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "3e-2", "--eval-iters", "0", "--log-interval", "1",
         "--unit-scaling", "--residual-tau", "0.2", "--post-norm", "--no-pre-norm"]
STATIC_FLAGS = ["--fp8-format", "hybrid", "--fp8-recipe", "static", "--fp8-static-grad-scale", "256"]


def _pretrain(*flags: str) -> str:
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *flags], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def _losses(log_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


def test_unit_scaled_model_with_static_casts_tracks_fp32_and_resumes_bit_exact(tmp_path):
    prefix = str(tmp_path / "text_document")
    write_synthetic_dataset(prefix, [50] * 200, vocab_size=500)
    run = [*MODEL, "--data-path", prefix, "--train-iters", "8"]
    _pretrain(*run, "--log-dir", str(tmp_path / "fp32"))
    ckpt = str(tmp_path / "ckpt")
    out = _pretrain(*run, *STATIC_FLAGS, "--save", ckpt, "--save-interval", "4", "--log-dir", str(tmp_path / "static"))
    assert "FP8 hybrid static" in out
    fp32, static = _losses(tmp_path / "fp32"), _losses(tmp_path / "static")
    assert static != fp32
    # 0.5%: measured on this model over 40 steps, the largest deviation from fp32 was 0.23% (docs/training.md).
    assert all(abs(static[i] - fp32[i]) <= 5e-3 * fp32[i] for i in fp32), (static, fp32)

    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")  # back to iteration 4 (Megatron's way)
    _pretrain(*run, *STATIC_FLAGS, "--load", ckpt, "--log-dir", str(tmp_path / "resumed"))
    assert _losses(tmp_path / "resumed") == {i: static[i] for i in range(5, 9)}

    exported = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", ckpt,
                       "--save-dir", tmp_path / "hf")
    assert exported.returncode == 1 and "--unit-scaling, --residual-tau" in exported.stderr


@pytest.mark.parametrize("flags, message", [
    (["--fp8-format", "e4m3", "--fp8-recipe", "static"], "--fp8-recipe static needs a unit-scaled model"),
    (["--fp8-static-grad-scale", "4"], "--fp8-static-grad-scale needs --fp8-format and --fp8-recipe static"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "static", "--unit-scaling", "--fp8-static-grad-scale", "3"],
     "--fp8-static-grad-scale must be a power of two"),
    (["--unit-scaling", "--init-method-std", "0.5"], "--init-method-std with --unit-scaling"),
    (["--residual-tau", "1.5"], "--residual-tau must be in (0, 1)"),
])
def test_misused_static_and_unit_scaling_flags_are_refused_in_one_line(flags, message):
    base = [*LLAMA_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
            "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    _, errors, _ = parse_and_check([*base, *flags])
    assert len(errors) == 1 and message in errors[0], errors
    _, errors, _ = parse_and_check([*base, "--fp8-format", "e4m3", "--fp8-recipe", "static",
                                    "--allow-static-fp8-without-unit-scaling"])
    assert errors == []
