"""The microscaling recipes through the training entry (`megafp8.pretrain`), the way users reach them: MXFP8
(`--fp8-recipe mxfp8`), NVFP4 (`--fp4-format e2m1`, Megatron's flags: stochastic rounding, Hadamard wgrad and 16x16
weights on by default) and MXFP4. At TP2 x PP2 x DP2 with sequence parallelism and ZeRO every recipe trains, a run
resumed from its checkpoint is bit-exact with the straight run (the stochastic rounding's keys are a function of the
seed and the iteration, so nothing else needs saving), a TP1 run loads the 3D checkpoint (reshard on load), and the
losses track the fp32 run of the same layout within each recipe's bound; the flags' misuse is refused in one line.

The bounds are relative, on the loss of a 4-layer, 64-wide model over 6 steps: 1% for MXFP8, 3% for FP4 (measured on
this model over 20 single-process steps, the largest deviation from fp32: MXFP8 0.014%, NVFP4 0.15%, MXFP4 0.20%; the
bounds leave room for the 3D layout's other reduction orders and stochastic draws).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_fixtures import REPO_ROOT, write_synthetic_dataset
from megafp8.training.arguments import parse_and_check
from megafp8.training.megatron_flags import LLAMA_FLAGS

TIMEOUT = 600
MODEL = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--num-layers", "4",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
         "--distributed-timeout-minutes", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"]
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
RECIPES = {
    "mxfp8": ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
    "nvfp4": ["--fp4-format", "e2m1"],
    "mxfp4": ["--fp4-format", "e2m1", "--fp4-recipe", "mxfp4"],
}
LOSS_RTOL = {"mxfp8": 0.01, "nvfp4": 0.03, "mxfp4": 0.03}


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "synthetic_text_document")
    write_synthetic_dataset(prefix, [50] * 200, vocab_size=500)
    return prefix


def _pretrain(nproc: int, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megafp8.pretrain", *flags]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "megafp8.pretrain", *flags]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _run(nproc: int, *flags: str) -> str:
    result = _pretrain(nproc, *flags)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def _losses(log_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


def _assert_tracks(losses: dict[int, float], reference: dict[int, float], rtol: float) -> None:
    assert losses.keys() == reference.keys()
    for it, ref in reference.items():
        assert math.isfinite(losses[it]) and abs(losses[it] - ref) <= rtol * abs(ref), (it, losses, reference)


@pytest.fixture(scope="module")
def fp32_3d(data_prefix, tmp_path_factory) -> dict[int, float]:
    log_dir = tmp_path_factory.mktemp("fp32_3d")
    _run(8, *MODEL, *LAYOUT_3D, "--train-iters", "6", "--data-path", data_prefix, "--log-dir", str(log_dir))
    return _losses(log_dir)


@pytest.mark.parametrize("recipe", [
    pytest.param("mxfp8", marks=pytest.mark.slow), "nvfp4", pytest.param("mxfp4", marks=pytest.mark.slow)])
def test_3d_run_tracks_fp32_resumes_bit_exact_and_reshards(recipe, data_prefix, fp32_3d, tmp_path):
    run = [*MODEL, *RECIPES[recipe], "--data-path", data_prefix, "--train-iters", "6"]
    out = _run(8, *run, *LAYOUT_3D, "--log-dir", str(tmp_path / "straight"))
    assert ("FP4 e2m1 " + recipe if recipe != "mxfp8" else "MXFP8 e4m3") in out
    straight = _losses(tmp_path / "straight")
    _assert_tracks(straight, fp32_3d, LOSS_RTOL[recipe])
    ckpt = str(tmp_path / "ckpt")
    if recipe == "nvfp4":
        # The ZeRO gather of packed NVFP4 bytes: the weights the layers get are the bytes they would quantize from
        # the fp32 weight themselves, so the run is the same bit for bit, and the resume below runs with it too.
        run.append("--fp4-param-gather")
        _run(8, *run, *LAYOUT_3D, "--save", ckpt, "--save-interval", "3", "--log-dir", str(tmp_path / "gathered"))
        assert _losses(tmp_path / "gathered") == straight
        (Path(ckpt) / "latest_checkpointed_iteration.txt").write_text("3")  # resume from iteration 3 (Megatron's way)
    else:
        _run(8, *run, *LAYOUT_3D, "--exit-interval", "3", "--save", ckpt, "--log-dir", str(tmp_path / "first"))
    _run(8, *run, *LAYOUT_3D, "--load", ckpt, "--log-dir", str(tmp_path / "resumed"))
    resumed = _losses(tmp_path / "resumed")
    assert resumed == {it: straight[it] for it in (4, 5, 6)}  # bit for bit, stochastic rounding included

    # The 3D checkpoint loaded by one process (TP1, PP1, DP1): resharded on load, and it goes on training.
    _run(1, *run, "--load", ckpt, "--log-dir", str(tmp_path / "resharded"))
    _assert_tracks(_losses(tmp_path / "resharded"), {it: straight[it] for it in (4, 5, 6)}, LOSS_RTOL[recipe])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_single_process_run_tracks_fp32(recipe, data_prefix, tmp_path):
    run = [*MODEL, "--data-path", data_prefix, "--train-iters", "6"]
    _run(1, *run, "--log-dir", str(tmp_path / "fp32"))
    _run(1, *run, *RECIPES[recipe], "--log-dir", str(tmp_path / recipe))
    _assert_tracks(_losses(tmp_path / recipe), _losses(tmp_path / "fp32"), LOSS_RTOL[recipe])


def test_fp4_ablation_switches_change_the_bits_and_still_train(data_prefix, tmp_path):
    """Each switch of NVFP4's recipe (the NVFP4 paper's ablation) reaches the layers: the losses differ from the
    default recipe's, and stay within the FP4 bound of fp32."""
    run = [*MODEL, "--data-path", data_prefix, "--train-iters", "3", *RECIPES["nvfp4"]]
    _run(1, *run, "--log-dir", str(tmp_path / "default"))
    default = _losses(tmp_path / "default")
    for switch in ("--fp4-no-stochastic-rounding", "--fp4-no-hadamard", "--fp4-no-2d-weights"):
        log_dir = tmp_path / switch.strip("-")
        _run(1, *run, switch, "--log-dir", str(log_dir))
        ablated = _losses(log_dir)
        assert ablated != default, switch
        _assert_tracks(ablated, default, 2 * LOSS_RTOL["nvfp4"])


@pytest.mark.parametrize("flags, message", [
    (["--fp4-recipe", "mxfp4"], "--fp4-recipe needs --fp4-format e2m1"),
    (["--fp4-format", "e2m1", "--fp4-recipe", "mxfp4", "--fp4-param-gather"], "--fp4-param-gather needs --fp4-format"),
    (["--fp4-format", "e2m1", "--fp4-no-2d-weights", "--fp4-param-gather"], "--fp4-param-gather with --fp4-no-2d"),
    (["--fp4-format", "e2m1", "--fp8-param-gather"], "--fp8-param-gather with --fp4-format"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather"], "--fp8-param-gather with the mxfp8"),
    (["--fp4-format", "e2m1", "--seq-length", "9", "--micro-batch-size", "1", "--global-batch-size", "2"],
     "is not a multiple (or pass --fp4-no-hadamard)"),
    (["--fp8-format", "e4m3", "--mx-scale-rounding", "floor"], "--mx-scale-rounding needs --fp8-recipe mxfp8"),
])
def test_misused_flags_are_refused_in_one_line(flags, message):
    _, errors, _ = parse_and_check([*MODEL, "--mock-data", *flags], world_size=2)
    assert any(message in e for e in errors), errors


def test_fp4_flags_select_the_recipe_with_megatron_names():
    args, errors, _ = parse_and_check([*MODEL, "--mock-data", "--fp4-format", "e2m1", "--fp4-recipe", "mxfp4",
                                       "--mx-scale-rounding", "floor", "--train-iters", "1"], world_size=1)
    assert not errors
    from megafp8.fp8 import Fp8Recipe

    recipe = Fp8Recipe.from_args(args)
    assert (recipe.scaling, recipe.element_bits, recipe.mx_scale_rounding) == ("mxfp4", 4, "floor")
    assert recipe.quantizer("grad_output").stochastic and recipe.quantizer("input").hadamard_transposed
    assert not recipe.quantizer("weight").stochastic


def test_precision_schedule_switches_once_and_a_resume_across_the_switch_is_bit_exact(data_prefix, tmp_path):
    """--fp4-until-iteration 3: iterations 1-3 are the plain NVFP4 run's bits, 4-6 run in high precision; a run
    saved at iteration 2 and resumed switches at the same iteration and is bit-exact with the straight run."""
    run = [*MODEL, *RECIPES["nvfp4"], "--data-path", data_prefix, "--train-iters", "6"]
    _run(1, *run, "--log-dir", str(tmp_path / "plain"))
    plain = _losses(tmp_path / "plain")
    scheduled = [*run, "--fp4-until-iteration", "3"]
    out = _run(1, *scheduled, "--log-dir", str(tmp_path / "straight"))
    assert out.count("precision schedule: FP4 layers switch to high precision at iteration 4") == 1
    straight = _losses(tmp_path / "straight")
    assert [straight[i] for i in (1, 2, 3)] == [plain[i] for i in (1, 2, 3)]
    assert all(straight[i] != plain[i] for i in (4, 5, 6))

    ckpt = str(tmp_path / "ckpt")
    _run(1, *scheduled, "--exit-interval", "2", "--save", ckpt, "--log-dir", str(tmp_path / "first"))
    out = _run(1, *scheduled, "--load", ckpt, "--log-dir", str(tmp_path / "resumed"))
    assert "switch to high precision at iteration 4" in out
    assert _losses(tmp_path / "resumed") == {i: straight[i] for i in (3, 4, 5, 6)}


@pytest.mark.slow  # CI time: the switch and its resume run by default above
def test_precision_schedule_variants_switch_their_gemms_and_gather_in_high_precision_after(data_prefix, tmp_path):
    """The forward-only variant (--fp4-switch-gemms fprop) and a switch to MXFP8 are other runs from iteration 4 on;
    under --fp4-param-gather the switched weights go back to the high-precision gather: the same bits."""
    run = [*MODEL, *RECIPES["nvfp4"], "--data-path", data_prefix, "--train-iters", "6"]
    _run(1, *run, "--log-dir", str(tmp_path / "plain"))
    plain = _losses(tmp_path / "plain")
    scheduled = [*run, "--fp4-until-iteration", "3"]
    _run(1, *scheduled, "--log-dir", str(tmp_path / "straight"))
    straight = _losses(tmp_path / "straight")

    # fprop-only: iteration 4's forward (its loss) is the full switch's, its NVFP4 backward makes 5 and 6 differ.
    others = {}
    for variant, differ_from in ((["--fp4-switch-gemms", "fprop"], (5, 6)), (["--fp4-switch-to", "mxfp8"], (4, 5, 6))):
        log_dir = tmp_path / variant[1]
        _run(1, *scheduled, *variant, "--log-dir", str(log_dir))
        other = others[variant[1]] = _losses(log_dir)
        assert [other[i] for i in (1, 2, 3)] == [plain[i] for i in (1, 2, 3)], variant
        assert all(other[i] != straight[i] for i in differ_from), variant
        _assert_tracks(other, straight, LOSS_RTOL["nvfp4"])

    # Under --fp4-param-gather the weights gathered as NVFP4 bytes go back to a high-precision gather at the switch
    # (to BF16, or to MXFP8, whose weights are not gathered as bytes): the same bits as without it.
    for variant, reference in (([], straight), (["--fp4-switch-to", "mxfp8"], others["mxfp8"])):
        log_dir = tmp_path / ("gathered" + "".join(variant))
        _run(1, *scheduled, *variant, "--fp4-param-gather", "--log-dir", str(log_dir))
        assert _losses(log_dir) == reference, variant


@pytest.mark.parametrize("flags, message", [
    (["--fp4-until-iteration", "3"], "--fp4-until-iteration/--fp4-until-fraction need --fp4-format e2m1"),
    (["--fp4-format", "e2m1", "--fp4-until-fraction", "1.5"], "--fp4-until-fraction must be in (0, 1)"),
    (["--fp4-format", "e2m1", "--fp4-switch-to", "mxfp8"], "--fp4-switch-to needs --fp4-until-iteration"),
    (["--fp4-format", "e2m1", "--fp4-until-iteration", "3", "--fp4-switch-gemms", "fprop", "--sequence-parallel",
      "--tensor-model-parallel-size", "2"], "--fp4-switch-gemms fprop with --sequence-parallel"),
])
def test_misused_schedule_flags_are_refused_in_one_line(flags, message):
    _, errors, _ = parse_and_check([*MODEL, "--mock-data", "--train-iters", "6", *flags], world_size=2)
    assert any(message in e for e in errors), errors
