"""--fp4-until-grad-noise ("FP4 All the Way"'s switch): the probe's two sums against fp64 and the layer's own
gradient, and the trigger through the training entry at PP2 x DP2: it leaves the bits alone until it fires, then
runs exactly the --fp4-until-iteration schedule of the iteration it fired at, and a resume after it is bit-exact."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megafp8.fp8 import Fp8Linear, Fp8Recipe
from megafp8.fp8.grad_noise import enable_grad_noise_probes, grad_noise_probes
from megafp8.training.arguments import parse_and_check
from test_microscaling_training import MODEL, RECIPES, _losses, _run, data_prefix  # noqa: F401 (a fixture)

pytestmark = pytest.mark.distributed


def _layer_gradients(probe: bool, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, Fp8Linear]:
    torch.manual_seed(0)
    layer = Fp8Linear(64, 32, bias=False, recipe=Fp8Recipe.named("nvfp4"))
    enable_grad_noise_probes(layer, probe)
    for micro_batch in range(2):
        layer(x[micro_batch]).backward(dy[micro_batch])
    return layer.weight.grad.clone(), layer


def test_the_probe_measures_the_fp4_wgrad_against_fp64_and_leaves_the_gradient_alone():
    torch.manual_seed(1)
    x, dy = torch.randn(2, 32, 64), torch.randn(2, 32, 32) * 1e-3
    plain, _ = _layer_gradients(False, x, dy)
    probed, layer = _layer_gradients(True, x, dy)
    assert torch.equal(probed, plain)  # the probe's GEMMs write only its buffers
    (probe,) = grad_noise_probes(layer)
    exact64 = sum(dy[m].double().t() @ x[m].double() for m in range(2))
    torch.testing.assert_close(probe.exact.double(), exact64, rtol=1e-5, atol=1e-9)
    # exact + noise is the FP4 wgrad the step accumulated (the same GEMM on the same operands), up to fp32 sums.
    torch.testing.assert_close(probe.exact + probe.noise, plain, rtol=1e-5, atol=1e-9)
    ratio = probe.exact.norm() / probe.noise.norm()
    assert 1.0 < ratio < 100.0  # 4-bit operands: a noise of a few to tens of percent of the gradient
    enable_grad_noise_probes(layer, False)
    assert grad_noise_probes(layer) == []


def _probes(log_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["fp4_grad_noise_ratio"] for r in records if "fp4_grad_noise_ratio" in r}


def test_the_trigger_runs_the_schedule_it_fired_and_resumes_bit_exact(data_prefix, tmp_path):  # noqa: F811
    """PP2 x DP2, NVFP4, probes every 2 iterations. Never firing (threshold 1e-9): a finite ratio at 2, 4, 6 and,
    until the other run's switch, its bits. Firing at once (threshold 1e9): fires at 2, so iterations 3-6 are the --fp4-until-iteration 2
    run's bits; saved at 4 and resumed, the run switches before its first step (the checkpoint kept the iteration;
    without it the resumed run would probe at 6 and stay in FP4 through it)."""
    run = [*MODEL, *RECIPES["nvfp4"], "--data-path", data_prefix, "--train-iters", "6",
           "--pipeline-model-parallel-size", "2"]
    trigger = [*run, "--fp4-until-grad-noise", "--fp4-grad-noise-interval", "2"]
    out = _run(4, *trigger, "--fp4-grad-noise-threshold", "1e-9", "--log-dir", str(tmp_path / "never"))
    assert "precision schedule" not in out
    ratios = _probes(tmp_path / "never")
    assert ratios.keys() == {2, 4, 6} and all(math.isfinite(r) and r > 0 for r in ratios.values()), ratios

    _run(4, *run, "--fp4-until-iteration", "2", "--log-dir", str(tmp_path / "scheduled"))
    scheduled = _losses(tmp_path / "scheduled")
    never = _losses(tmp_path / "never")
    assert [never[i] for i in (1, 2)] == [scheduled[i] for i in (1, 2)]  # the probes left the FP4 steps' bits alone
    assert all(never[i] != scheduled[i] for i in (3, 4, 5, 6))
    fired = [*trigger, "--fp4-grad-noise-threshold", "1e9", "--save", str(tmp_path / "ckpt")]
    out = _run(4, *fired, "--exit-interval", "4", "--log-dir", str(tmp_path / "fired"))
    assert out.count("precision schedule: at iteration 2 the FP4 weight gradients' norm is") == 1
    assert out.count("FP4 layers switch to high precision at iteration 3") == 2  # each stage's lead says it
    assert _probes(tmp_path / "fired") == {2: ratios[2]}  # the same measurement; no probe after the switch
    out = _run(4, *fired, "--load", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "resumed"))
    assert "FP4 layers switch to high precision at iteration 3" in out and not _probes(tmp_path / "resumed")
    assert {**_losses(tmp_path / "fired"), **_losses(tmp_path / "resumed")} == scheduled


@pytest.mark.parametrize("flags, message", [
    (["--fp4-until-grad-noise"], "--fp4-until-grad-noise needs --fp4-format e2m1"),
    (["--fp4-format", "e2m1", "--fp4-grad-noise-interval", "5"], "--fp4-grad-noise-interval needs --fp4-until-grad"),
    (["--fp4-format", "e2m1", "--fp4-until-grad-noise", "--fp4-grad-noise-threshold", "0"],
     "--fp4-grad-noise-threshold must be > 0"),
    (["--fp4-format", "e2m1", "--fp4-until-grad-noise", "--sequence-parallel", "--tensor-model-parallel-size", "2"],
     "--fp4-until-grad-noise with --sequence-parallel"),
])
def test_misused_trigger_flags_are_refused_in_one_line(flags, message):
    _, errors, _ = parse_and_check([*MODEL, "--mock-data", "--train-iters", "6", *flags], world_size=2)
    assert any(message in e for e in errors), errors
