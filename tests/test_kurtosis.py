"""The kurtosis monitor (issue 32, megafp8.fp8.kurtosis): 3 on Gaussian and 6 on Laplace inputs against fp64, the
FP8 layers' recorded inputs (a fused RMSNorm prologue's normalized input included) against an fp64 recomputation,
the same values at TP=2 + SP built from scratch as at TP=1, the warning rule, and the training entry's
metrics.jsonl."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from data_fixtures import REPO_ROOT
from distributed_testing import run_distributed
from megafp8.fp8 import Fp8Recipe
from megafp8.fp8.kurtosis import KurtosisWarning, collect_kurtosis, enable_kurtosis, input_moments, kurtosis_and_rms
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.megatron_flags import LLAMA_FLAGS


def _fp64_kurtosis(x: torch.Tensor) -> float:
    x = x.double().flatten()
    centred = x - x.mean()
    return ((centred ** 4).mean() / (centred ** 2).mean() ** 2).item()


@pytest.mark.parametrize("distribution,expected", [("normal", 3.0), ("laplace", 6.0)])
def test_kurtosis_of_gaussian_and_laplace_inputs(distribution, expected):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=g)
    if distribution == "laplace":  # -sign(u) log(1 - 2|u|), u uniform in (-1/2, 1/2)
        u = torch.rand(1 << 20, generator=g) - 0.5
        x = -torch.sign(u) * torch.log1p(-2 * u.abs())
    x = 0.3 + 2.0 * x  # a mean and a scale: kurtosis ignores both
    kurtosis, rms = kurtosis_and_rms(input_moments(x))
    assert abs(kurtosis.item() - _fp64_kurtosis(x)) <= 1e-9 * _fp64_kurtosis(x)
    assert abs(kurtosis.item() - expected) <= 0.03 * expected
    assert abs(rms.item() - x.double().pow(2).mean().sqrt().item()) <= 1e-12


def _config() -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       seq_length=32, vocab_size=100, make_vocab_size_divisible_by=16, seed=3)


def _ids(config: ModelConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(1))


def test_fp8_layers_record_their_inputs_including_a_fused_prologues_normalized_input():
    config = _config()
    model = GPTModel(config, ParallelState().init_process_groups(), fp8_recipe=Fp8Recipe.delayed(amax_history_len=4))
    seen = {}
    norm = model.layers["0"].input_layernorm
    norm.register_forward_pre_hook(lambda module, args: seen.setdefault("x", args[0].detach()))
    enable_kurtosis(model, True)
    model(_ids(config))
    values = collect_kurtosis(model)
    assert len([k for k in values if k.endswith("/kurtosis")]) == 4 * config.num_layers  # every FP8 linear
    x = seen["x"].double()  # QKV's input is RMSNorm(x), which the fused prologue never writes in high precision
    normalized = norm.weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    assert abs(values["fp8/layers.0.self_attention.linear_qkv/input/kurtosis"] - _fp64_kurtosis(normalized)) <= 1e-6
    enable_kurtosis(model, False)
    assert collect_kurtosis(model) == {}  # off: nothing recorded, nothing collected


def test_a_steps_micro_batches_add_up_and_a_recomputed_forward_adds_nothing():
    """Two micro-batches' moments sum to the kurtosis of both together (the step's, at any micro-batch size), the
    forward that activation recompute repeats in backward is not counted again, and enabling starts from zero."""
    config = dataclasses.replace(_config(), recompute_granularity="full", recompute_method="uniform",
                                 recompute_num_layers=1)
    model = GPTModel(config, ParallelState().init_process_groups(), fp8_recipe=Fp8Recipe.delayed(amax_history_len=4))
    seen = []
    norm = model.layers["0"].input_layernorm
    norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    enable_kurtosis(model, True)
    model(_ids(config)).float().sum().backward()  # a stale micro-batch, dropped by the enable below
    enable_kurtosis(model, True)
    seen.clear()
    for seed in (5, 6):
        ids = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(seed))
        model(ids).float().sum().backward()  # full recompute: layer 0's forward runs again in backward
    x = torch.cat(seen[0::2]).double()  # the two forwards (each one's recomputation repeats the same input)
    normalized = norm.weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    assert model.layers["0"].self_attention.linear_qkv.input_moments[0].item() == x.numel()  # each element once
    value = collect_kurtosis(model)["fp8/layers.0.self_attention.linear_qkv/input/kurtosis"]
    assert abs(value - _fp64_kurtosis(normalized)) <= 1e-6 * value
    one = torch.cat(seen[0:1]).double()
    one = norm.weight.double() * one * torch.rsqrt(one.pow(2).mean(-1, keepdim=True) + norm.eps)
    assert abs(value - _fp64_kurtosis(one)) > 1e-3 * value  # not the last micro-batch's alone


def _tp_body(rank: int, world_size: int) -> None:
    config, recipe = _config(), Fp8Recipe.delayed(amax_history_len=4)
    ids = _ids(config)
    reference = GPTModel(config, ParallelState().init_process_groups(), fp8_recipe=recipe)
    enable_kurtosis(reference, True)
    reference(ids)
    expected = collect_kurtosis(reference)
    ps = ParallelState(world_size=world_size, tensor_model_parallel_size=world_size,
                       sequence_parallel=True).init_process_groups(rank)
    sharded = GPTModel(config, ps, fp8_recipe=recipe)  # from scratch: layout-invariant init
    enable_kurtosis(sharded, True)
    sharded(ids)
    values = collect_kurtosis(sharded, lambda t: dist.all_reduce(t, group=ps.tp_group.group))
    assert values.keys() == expected.keys()
    for key, value in values.items():  # sequence shards (QKV, FC1 under SP) and hidden slices (proj, FC2) summed
        assert abs(value - expected[key]) <= 1e-3 * abs(expected[key]), (key, value, expected[key])


def test_kurtosis_is_the_same_at_tp2_sp_built_from_scratch():
    run_distributed(_tp_body, world_size=2)


def test_warning_fires_once_when_kurtosis_doubles_over_the_window():
    warning = KurtosisWarning(ratio=2.0, window=3)
    key = "fp8/layers.1.mlp.linear_fc2/input/kurtosis"
    lines = [warning.check(i, {key: value}) for i, value in enumerate([4.0, 3.0, 5.0, 5.9, 6.1, 9.0, 3.5, 8.0])]
    assert [i for i, line in enumerate(lines) if line] == [4, 7]  # 6.1 >= 2 x 3.0; 9.0 not again; 8.0 >= 2 x 3.5
    assert "layers.1.mlp.linear_fc2's input kurtosis 6.1 is 2.0x its lowest of the last 3 logs (3.0)" in \
        lines[4][0].message
    assert (lines[4][0].layer, lines[4][0].kurtosis, lines[4][0].low) == ("layers.1.mlp.linear_fc2", 6.1, 3.0)
    with pytest.raises(ValueError, match="--kurtosis-warning-ratio"):
        KurtosisWarning(ratio=1.0)


def test_warning_windows_round_trip_through_their_state():
    """A warning restored from state_dict() (a checkpoint, with --fp8-saturation-guard-kurtosis) alarms exactly where
    the uninterrupted one does; a fresh one, with empty windows, does not."""
    key = "fp8/layers.0.linear_proj/input/kurtosis"
    values = [3.0, 3.2, 3.1, 6.5, 2.9, 7.0]
    whole = KurtosisWarning(ratio=2.0, window=3)
    expected = [bool(whole.check(i, {key: v})) for i, v in enumerate(values)]
    first = KurtosisWarning(ratio=2.0, window=3)
    for i, v in enumerate(values[:3]):
        first.check(i, {key: v})
    resumed, fresh = KurtosisWarning(ratio=2.0, window=3), KurtosisWarning(ratio=2.0, window=3)
    resumed.load_state_dict(first.state_dict())
    alarms = [bool(resumed.check(i, {key: v})) for i, v in enumerate(values[3:], 3)]
    assert alarms == expected[3:] == [True, False, True]
    assert not fresh.check(3, {key: values[3]})


def test_training_entry_writes_kurtosis_to_metrics(tmp_path):
    flags = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-layers", "2",
             "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "4", "--mock-data", "--eval-iters", "0",
             "--log-interval", "2", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--log-fp8-telemetry",
             "--log-dir", str(tmp_path)]
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *flags], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kurtosis = [r["input_kurtosis"] for r in records if "input_kurtosis" in r]
    assert len(kurtosis) == 2 and len(kurtosis[-1]) == 8  # both logged iterations, every FP8 linear
    assert all(1 < value < 100 for value in kurtosis[-1].values())


def _outlier_run(tmp_path, spec: str, iters: int) -> tuple[list[int], list[int], str]:
    """(kurtosis warning iterations for the layer, guard switch iterations, stdout) of a run under the forced-outlier
    hook (megafp8.fp8.forced_outlier) on layers.1.mlp.linear_fc2."""
    flags = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-layers", "2",
             "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4",
             "--global-batch-size", "4", "--train-iters", str(iters), "--mock-data", "--eval-iters", "0",
             "--log-interval", "1", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--log-fp8-telemetry",
             "--log-dir", str(tmp_path)]
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *flags], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "MEGAFP8_FORCE_OUTLIER": spec})
    assert result.returncode == 0, result.stderr[-3000:]
    layer = "layers.1.mlp.linear_fc2"
    warned = [int(line.split("iteration ")[1].split(":")[0]) for line in result.stdout.splitlines()
              if "kurtosis warning" in line and f"{layer}'s input" in line]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    switched = [r["iteration"] for r in records if r.get("fp8_guard_switch") == layer]
    return warned, switched, result.stdout


def test_kurtosis_warns_before_the_saturation_guard_trips_on_a_growing_outlier(tmp_path):
    """FOG's claim, measured through the entry: an outlier feature growing 8x per iteration from iteration 6 in
    1/32 of FC2's input channels. The kurtosis warning fires at its first logged iteration; the delayed scale's lag
    makes the casts saturate, and the guard (1% for 3 checks) moves the layer to high precision 3 iterations later.
    At a slower growth (1.5x) the guard never trips at all (1/32 of the channels, the growth inside the lag, saturate
    under 1% of the input), while the warning still fires within 2 iterations."""
    warned, switched, stdout = _outlier_run(tmp_path / "fast", "layers.1.mlp.linear_fc2@6x8", 14)
    assert "test hook MEGAFP8_FORCE_OUTLIER" in stdout
    assert warned and warned[0] == 6, stdout[-2000:]
    assert switched == [9], switched
    warned, switched, _ = _outlier_run(tmp_path / "slow", "layers.1.mlp.linear_fc2@6x1.5", 12)
    assert warned and warned[0] <= 8 and switched == []


def _kurtosis_guard_run(tmp_path, nproc: int, *extra: str, iters: int = 12) -> tuple[list[dict], str]:
    """metrics.jsonl records and stdout of a run with --fp8-saturation-guard-kurtosis under the forced outlier
    (8x per iteration from iteration 6: the warning fires at 6, the saturation guard alone trips at 9, the test
    above)."""
    flags = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-layers", "2",
             "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", str(4 // nproc // nproc), "--global-batch-size", "4", "--train-iters", str(iters),
             "--mock-data", "--eval-iters", "0", "--log-interval", "1", "--fp8-format", "hybrid", "--fp8-recipe",
             "delayed", "--log-fp8-telemetry", "--fp8-saturation-guard-kurtosis", "--use-distributed-optimizer",
             "--log-dir", str(tmp_path), *extra]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    result = subprocess.run([*launcher, "-m", "megafp8.pretrain", *flags], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                         "MEGAFP8_FORCE_OUTLIER": "layers.1.mlp.linear_fc2@6x8"})
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()], result.stdout


def test_guard_switches_at_the_kurtosis_warning_on_every_rank_and_after_a_resume(tmp_path):
    """--fp8-saturation-guard-kurtosis through the entry: the layer moves to high precision at its warning (logged
    with its kurtosis, saturation null), 3 iterations before the saturation guard would have moved it. At DP2 (two
    micro-batches of one sample per rank), stopped just before the outlier and resumed, the kurtosis (moments summed
    over the micro-batches and both ranks) warns and switches at the iteration of the one-process run with the whole
    batch, and the losses follow it; that needs the warning's windows from the checkpoint (with empty windows the
    first iteration after the resume cannot warn: checked by breaking it)."""
    layer = "layers.1.mlp.linear_fc2"
    records, stdout = _kurtosis_guard_run(tmp_path / "one", 1)
    switches = [r for r in records if "fp8_guard_switch" in r]
    assert [(r["fp8_guard_switch"], r["saturated"]) for r in switches] == [(layer, None)], switches
    switched_at = switches[0]["iteration"]
    assert switched_at == 6 and switches[0]["kurtosis"] > 6, switches
    assert f"fp8 guard: {layer} input kurtosis" in stdout and "(--fp8-saturation-guard-kurtosis)" in stdout
    loss = {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}

    checkpoints = tmp_path / "ckpt"
    first, _ = _kurtosis_guard_run(tmp_path / "first", 2, "--save", str(checkpoints), "--exit-interval", "5")
    # Each DP rank holds half the batch in two micro-batches: the kurtosis both decide on is the whole batch's, the one
    # process's. Compared
    # where no FP8 cast lies upstream (the first layer's QKV input at the first step: the normalized embeddings), as
    # FP8 rounding moves later kurtoses by ~1%; a rank's own half differs by several %.
    qkv = "layers.0.self_attention.linear_qkv"
    whole = next(r["input_kurtosis"][qkv] for r in records if "input_kurtosis" in r)
    both = next(r["input_kurtosis"][qkv] for r in first if "input_kurtosis" in r)
    assert abs(both - whole) <= 1e-9 * whole, (both, whole)
    resumed, _ = _kurtosis_guard_run(tmp_path / "resumed", 2, "--load", str(checkpoints))
    assert [(r["iteration"], r["fp8_guard_switch"]) for r in resumed if "fp8_guard_switch" in r] == \
        [(switched_at, layer)]
    resumed_loss = {r["iteration"]: r["lm_loss"] for r in resumed if "lm_loss" in r}
    assert sorted(resumed_loss) == list(range(6, 13))
    for iteration, value in resumed_loss.items():  # DP2 vs one process: the same batch, FP8 rounding apart
        assert abs(value - loss[iteration]) <= 2e-3 * loss[iteration], (iteration, value, loss[iteration])


def test_kurtosis_guard_flag_errors():
    from megafp8.training.arguments import parse_and_check

    base = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--train-iters", "2", "--mock-data", "--fp8-format", "hybrid", "--fp8-saturation-guard-kurtosis"]
    _, errors, _ = parse_and_check([*base, "--no-fp8-saturation-guard"], 1)
    assert any("drop --no-fp8-saturation-guard" in e for e in errors), errors
    assert any("needs --log-fp8-telemetry" in e for e in errors), errors
    _, errors, _ = parse_and_check([*base, "--log-fp8-telemetry"], 1)
    assert errors == []
    _, errors, _ = parse_and_check([*base, "--log-fp8-telemetry", "--num-experts", "4", "--expert-model-parallel-size",
                                    "2", "--use-distributed-optimizer"], 2)
    assert any("not built with --expert-model-parallel-size > 1" in e for e in errors), errors
    _, errors, _ = parse_and_check([*base, "--log-fp8-telemetry", "--num-experts", "4", "--expert-tensor-parallel-size",
                                    "2", "--use-distributed-optimizer"], 2)
    assert any("not built with --expert-tensor-parallel-size > 1" in e for e in errors), errors
