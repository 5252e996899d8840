"""The FP8 saturation guard under --fp8-param-gather: a layer the guard switches gets its high-precision weight,
decoded from the ZeRO owners' master shards and all-gathered over DP, from the next step on, while the other FP8
layers keep the FP8-byte gather; the switch survives a checkpoint. Checked at DP=2 against the same run without
--fp8-param-gather (every weight gathered in high precision, the layer switched at the same step): equal losses
and weights; the switched layer runs on exactly the master's values; the gather's bytes grow by that weight's
high-precision shard only; a save + resume in fresh processes keeps the switch and continues with the same losses.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from data_fixtures import REPO_ROOT, write_synthetic_dataset
from distributed_testing import run_distributed
from optim_testing import build, make_ddp, max_rel_diff, tiny_config, train_step
from megafp8.fp8 import Fp8Recipe
from megafp8.fp8.forced_overflow import ENV as FORCED_OVERFLOW_ENV
from megafp8.fp8.telemetry import Fp8TensorStats
from megafp8.optim import DistributedOptimizer
from megafp8.optim.fp8_param_cast import num_scale_groups
from megafp8.parallel.fp8_sequence_parallel import fp8_scaling_manager
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.checkpointing import Checkpointer
from megafp8.training.megatron_flags import LLAMA_FLAGS
from megafp8.training.train import TrainProgress, saturation_guard

LR, STEPS, SWITCH_AFTER, SAVE_AT = 1e-3, 5, 1, 3
TARGET = "layers.1.mlp.linear_fc1"  # 128 x 32: the DP shards of its bucket cut it 1024 / 3072 (padded gather)


def _setup(ps, fp8_param_gather: bool, overlap: bool = False, seed: int = 0):
    cfg = tiny_config()
    model = build(cfg, ps, seed=seed, fp8_recipe=Fp8Recipe.tensorwise())
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, fp8_param_gather=fp8_param_gather,
                   overlap_param_gather=overlap)
    opt = DistributedOptimizer(ddp, weight_decay=0.1)
    return cfg, model, ddp, opt, saturation_guard(ps), fp8_scaling_manager(model, ps)


def _switch(model, guard) -> None:
    """The guard's own decision: TARGET reports 50% saturated inputs for `patience` checks in a row."""
    target = dict(model.named_modules())[TARGET]
    for _ in range(guard.patience):
        target.fp8_telemetry = {"input": Fp8TensorStats(torch.ones(()), torch.ones(()), torch.tensor([8, 0]), 16)}
        guard.check(model)
    assert target.runs_high_precision and guard.switched == {TARGET}


def _steps(state, ps, first: int, count: int, switch_after: int | None = None):
    """Losses (mean over DP) and each step's dp_param_allgather bytes."""
    cfg, model, ddp, opt, guard, manager = state
    losses, gathered = [], []
    for step in range(first, first + count):
        ps.comm.reset()
        result, loss = train_step(ddp, opt, cfg, step, LR, before_step=manager.update)
        assert not result.skipped
        if step == switch_after:
            _switch(model, guard)  # after the step, as the training loop runs the guard
        mean = torch.tensor([loss])
        dist.all_reduce(mean, group=ps.dp_group.group)
        losses.append(mean.item() / ps.dp_size)
        gathered.append(ps.comm["dp_param_allgather"])
    return losses, gathered


def _full_master(opt, name: str) -> torch.Tensor:
    """One parameter's whole (TP-local) master weight, from every DP rank's owned range."""
    owned = {n: (start, values) for n, (_, start, values) in opt.owned_master_weights().items() if n == name}
    shards = [None] * opt.ddp.dp.size
    dist.all_gather_object(shards, owned, group=opt.ddp.dp.group)
    param = next(p for p, n in opt.ddp.param_names.items() if n == name)
    full = torch.full((param.numel(),), float("nan"))
    for shard in shards:
        for start, values in shard.values():
            full[start:start + values.numel()] = values
    return full.view(param.shape)


def _checkpointer(root, ps, model, opt, guard) -> Checkpointer:
    args = argparse.Namespace(save=root, load=root, keep_last=None, finetune=False, no_load_optim=False,
                              no_load_rng=False, allow_changed_args=None)
    return Checkpointer(args, ps, SimpleNamespace(chunks=[model]), opt, guard)


def _switch_body(rank, world_size, root):
    ps = ParallelState(world_size=world_size).init_process_groups()
    reference = _setup(ps, fp8_param_gather=False)
    ref_losses, _ = _steps(reference, ps, 0, STEPS, switch_after=SWITCH_AFTER)

    state = _setup(ps, fp8_param_gather=True)
    _, model, ddp, opt, guard, _ = state
    state_bytes = opt.model_state_bytes_per_param() * ddp.num_params()
    losses, gathered = _steps(state, ps, 0, SAVE_AT, switch_after=SWITCH_AFTER)
    progress = TrainProgress(iteration=SAVE_AT)
    _checkpointer(root, ps, model, opt, guard).save(SimpleNamespace(progress=progress, is_logging_rank=rank == 0))
    more, more_gathered = _steps(state, ps, SAVE_AT, STEPS - SAVE_AT)
    losses, gathered = losses + more, gathered + more_gathered
    if rank == 0:
        with open(f"{root}/continued.json", "w") as f:
            json.dump(more, f)

    # (a) The switched layer runs on exactly the master's values, and the whole run equals the reference.
    target = dict(model.named_modules())[TARGET]
    assert target.weight in ddp.switched_weights and target.weight not in ddp.fp8_params
    assert torch.equal(target.weight.detach(), _full_master(opt, f"{TARGET}.weight"))
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 1e-6, (losses, ref_losses)
    ref_params = dict(reference[1].named_parameters())
    for name, p in model.named_parameters():
        if p in ddp.fp8_params:  # no high-precision values: compare the master
            assert p.untyped_storage().nbytes() <= p.element_size(), "no high-precision copy of an FP8 weight"
            assert max_rel_diff(_full_master(opt, name), ref_params[name].detach()) < 1e-5, name
        else:
            assert max_rel_diff(p.detach(), ref_params[name].detach()) < 1e-5, name

    # (b) The other FP8 layers still take their FP8 bytes; the gather grows by the switched weight's padded
    # high-precision shard (x (DP - 1) peers) and shrinks by its group in the MAX all-reduce of weight amaxes.
    assert len(ddp.fp8_params) == 7
    for p, info in ddp.fp8_params.items():
        assert info.module._injected_weight is not None, ddp.param_names[p]
    switched = ddp.switched_weights[target.weight]
    assert switched.pieces == [(0, 1024), (1024, 4096)] and switched.piece_numel == 3072
    n = world_size
    hp_bytes = switched.piece_numel * 4 * (n - 1)
    amax_bytes = 2 * 4 * num_scale_groups(tuple(target.weight.shape), Fp8Recipe.tensorwise().granularity("weight"))
    steady_before, switch_step, steady_after = gathered[SWITCH_AFTER], gathered[SWITCH_AFTER + 1], gathered[-1]
    assert steady_after == steady_before + hp_bytes - amax_bytes * (n - 1) // n, gathered
    assert switch_step == steady_after + hp_bytes, gathered  # + the on-demand gather at the first forward
    # The switched weight and its shard are resident now; its FP8 scale (one fp32) is not.
    assert opt.model_state_bytes_per_param() * ddp.num_params() == state_bytes + (4096 + 3072) * 4 - 4


def _resume_body(rank, world_size, root):
    ps = ParallelState(world_size=world_size).init_process_groups()
    state = _setup(ps, fp8_param_gather=True, seed=123)  # other weights: all must come from the checkpoint
    _, model, ddp, opt, guard, _ = state
    assert _checkpointer(root, ps, model, opt, guard).load()["iteration"] == SAVE_AT
    target = dict(model.named_modules())[TARGET]
    assert guard.switched == {TARGET} and target.weight in ddp.switched_weights  # published in high precision
    assert torch.equal(target.weight.detach(), _full_master(opt, f"{TARGET}.weight"))
    losses, _ = _steps(state, ps, SAVE_AT, STEPS - SAVE_AT)
    with open(f"{root}/continued.json") as f:
        assert losses == json.load(f)


@pytest.mark.distributed
def test_guard_switch_under_fp8_param_gather_matches_high_precision_gather(tmp_path):
    run_distributed(_switch_body, world_size=2, args=(str(tmp_path),), timeout_s=600)
    run_distributed(_resume_body, world_size=2, args=(str(tmp_path),), timeout_s=600)


def _tp_body(rank, world_size):
    ps = ParallelState(world_size=world_size, tensor_model_parallel_size=2).init_process_groups()
    ref_losses, _ = _steps(_setup(ps, fp8_param_gather=False), ps, 0, 3, switch_after=0)
    state = _setup(ps, fp8_param_gather=True)
    losses, _ = _steps(state, ps, 0, 3, switch_after=0)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 1e-6, (losses, ref_losses)
    _, model, ddp, opt, *_ = state
    target = dict(model.named_modules())[TARGET]
    assert target.weight in ddp.switched_weights and len(ddp.fp8_params) == 7
    assert torch.equal(target.weight.detach(), _full_master(opt, f"{TARGET}.weight"))


@pytest.mark.distributed
def test_guard_switch_under_fp8_param_gather_tp2_dp2():
    run_distributed(_tp_body, world_size=4, timeout_s=600)


def _overlap_body(rank, world_size):
    ps = ParallelState(world_size=world_size).init_process_groups()
    runs = [_setup(ps, fp8_param_gather=True, overlap=overlap) for overlap in (False, True)]
    results = [_steps(state, ps, 0, 3, switch_after=0)[0] for state in runs]
    assert results[0] == results[1]
    weights = []
    for _, model, ddp, *_ in runs:
        ddp.finish_param_sync()
        assert len(ddp.switched_weights) == 1 and len(ddp.fp8_params) == 7
        weights.append(dict(model.named_parameters())[f"{TARGET}.weight"].detach())
    assert torch.equal(*weights)


@pytest.mark.distributed
def test_guard_switch_with_overlap_param_gather(tmp_path):
    run_distributed(_overlap_body, world_size=2, timeout_s=600)


# ---- end to end: torchrun, 2 processes; the lead's forced-overflow hook makes one layer saturate ----------
PRETRAIN = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
            "--distributed-timeout-minutes", "1", "--split", "100,0,0", "--train-iters", "6",
            "--use-distributed-optimizer", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
            "--fp8-amax-compute-algo", "max", "--fp8-saturation-guard-patience", "3"]


def _pretrain(tmp, *flags: str, param_gather: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", FORCED_OVERFLOW_ENV: "layers.1.mlp.linear_fc2@1x16"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "megafp8.pretrain", *PRETRAIN, "--data-path", f"{tmp}/synthetic_text_document",
                             *(["--fp8-param-gather"] if param_gather else []), *flags],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def _logged_losses(log_dir) -> dict[int, float]:
    records = [json.loads(line) for line in open(f"{log_dir}/metrics.jsonl")]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


@pytest.mark.distributed
def test_pretrain_guard_switch_under_fp8_param_gather_resumes(tmp_path):
    write_synthetic_dataset(f"{tmp_path}/synthetic_text_document", [50] * 200, vocab_size=500)
    straight = _pretrain(tmp_path, "--save", f"{tmp_path}/save", "--save-interval", "4", "--log-dir", f"{tmp_path}/a")
    assert "layers.1.mlp.linear_fc2 saturated" in straight.stdout and "at iteration 3: switched" in straight.stdout
    losses = _logged_losses(f"{tmp_path}/a")
    assert sorted(losses) == list(range(1, 7)) and all(math.isfinite(v) for v in losses.values())
    # The reference: every weight gathered in high precision, the same layer switched at the same iteration.
    high_precision = _pretrain(tmp_path, "--log-dir", f"{tmp_path}/hp", param_gather=False)
    assert "at iteration 3: switched" in high_precision.stdout
    reference = _logged_losses(f"{tmp_path}/hp")
    assert max(abs(losses[i] - reference[i]) / reference[i] for i in reference) < 1e-6, (losses, reference)
    # Resume from iteration 4 (the switch is in the checkpoint; the forced overflow stays armed, so a layer that
    # came back in FP8 would saturate and change the losses).
    shutil.copytree(f"{tmp_path}/save/iter_0000004", f"{tmp_path}/resume/iter_0000004")
    with open(f"{tmp_path}/resume/latest_checkpointed_iteration.txt", "w") as f:
        f.write("4\n")
    resumed = _pretrain(tmp_path, "--load", f"{tmp_path}/resume", "--log-dir", f"{tmp_path}/b")
    assert "switched" not in resumed.stdout
    assert _logged_losses(f"{tmp_path}/b") == {5: losses[5], 6: losses[6]}
