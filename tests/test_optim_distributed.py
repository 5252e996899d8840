"""The ZeRO distributed optimizer against torch.optim.AdamW on the unsharded model (DP=1, 2, 4, with and
without overlapped grad reduction), plus step hygiene: overlap on/off bit-identical, NaN on one rank
skips the step everywhere with state untouched, byte counters equal the analytic count, and a
checkpoint saved at DP=4 loads at DP=2."""
import copy
import os

import pytest
import torch

from distributed_testing import run_distributed
from optim_testing import (build, global_batch, make_ddp, max_rel_diff, reference_adamw, reference_step,
                           tiny_config, train_step)
from megafp8.optim import DistributedOptimizer
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import build_pipeline
from megafp8.parallel.sharding import gather_tensor_model_parallel, shard_state_dict

LR, WD, CLIP, STEPS = 1e-3, 0.1, 0.5, 10
RESHARD_SEQUENCES = 16  # the global batch of the step after the reload, the same at DP=4 and DP=2


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(cfg, ps, steps, overlap, bucket_size=2000, distributed=True, **opt_kw):
    model = build(cfg, ps)
    ddp = make_ddp(model, ps, use_distributed_optimizer=distributed, overlap_grad_reduce=overlap,
                   overlap_param_gather=overlap and distributed, bucket_size=bucket_size)
    opt = DistributedOptimizer(ddp, weight_decay=WD, clip_grad=CLIP, **opt_kw)
    results = [train_step(ddp, opt, cfg, step, LR)[0] for step in range(steps)]
    ddp.finish_param_sync()
    return ddp, opt, results


def _matches_adamw_body(rank, world_size):
    cfg = tiny_config()
    ps = ParallelState(world_size=world_size).init_process_groups()
    reference = build(cfg, ParallelState().init_process_groups())
    ref_opt = reference_adamw(reference, LR, WD)
    for step in range(STEPS):
        reference_step(reference, ref_opt, cfg, step, world_size, CLIP)
    ref = _params(reference)
    finals = {}
    for distributed in (True, False):
        for overlap in (False, True):
            ps.comm.reset()
            ddp, opt, results = _run(cfg, ps, STEPS, overlap, distributed=distributed)
            assert not any(r.skipped for r in results)
            got = _params(ddp.module)
            for name, value in got.items():
                assert max_rel_diff(value, ref[name]) <= 1e-5, (distributed, overlap, name, max_rel_diff(value, ref[name]))
            finals[distributed, overlap] = got
            # Analytic DP bytes per step: reduce-scatter (all-reduce) of every bucket + the 8-byte norm reduce.
            n, grad_bytes = world_size, sum(b.numel for b in ddp.buckets) * 4
            per_step = (grad_bytes // n * (n - 1) if distributed else 2 * grad_bytes * (n - 1) // n) + 2 * 8 * (n - 1) // n
            assert ps.comm["dp_grad_reduce"] == STEPS * per_step if n > 1 else ps.comm["dp_grad_reduce"] == 0
            param_bytes = sum(b.numel for b in ddp.buckets) * 4 // n * (n - 1) if distributed else 0
            assert ps.comm["dp_param_allgather"] == (STEPS + 1) * param_bytes  # + the gather at construction
    for distributed in (True, False):  # overlap changes when reductions run, never what they compute
        for name in ref:
            assert torch.equal(finals[distributed, True][name], finals[distributed, False][name]), (distributed, name)


def test_distributed_optimizer_matches_torch_adamw_dp1():
    _matches_adamw_body(0, 1)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_optimizer_matches_torch_adamw(world_size):
    run_distributed(_matches_adamw_body, world_size=world_size, timeout_s=600)


def _snapshot(ddp, opt):
    return copy.deepcopy(opt.state_dict()), _params(ddp.module)


def _nan_body(rank, world_size):
    cfg = tiny_config()
    ps = ParallelState(world_size=world_size).init_process_groups()
    for state_dtype in ("fp32", "fp8"):
        ddp, opt, _ = _run(cfg, ps, 2, overlap=True, optimizer_state_dtype=state_dtype, master_weight_dtype="fp16")
        before_state, before_params = _snapshot(ddp, opt)
        opt.zero_grad()
        ids, labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length)), torch.zeros(2, cfg.seq_length, dtype=torch.long)
        handle = None
        if rank == 1:  # one element of one rank's gradient, before the overlapped reduction sees it
            handle = ddp.module.final_layernorm.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("nan")))
        ddp(ids, labels).mean().backward()
        if handle is not None:
            handle.remove()
        result = opt.step(LR)
        ddp.finish_param_sync()
        assert result.skipped and opt.skipped_steps == 1 and opt.step_count == 2
        after_state, after_params = _snapshot(ddp, opt)
        for name in before_params:
            assert torch.equal(before_params[name], after_params[name]), name
        for name, entry in before_state["fragments"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(_bytes(value), _bytes(after_state["fragments"][name][key])), (name, key)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # bit-level equality, FP8 codes included


@pytest.mark.distributed
def test_nan_on_one_rank_skips_everywhere():
    run_distributed(_nan_body, world_size=2, timeout_s=600)


def _save_body(rank, world_size, directory, state_dtype):
    cfg = tiny_config()
    ps = ParallelState(world_size=world_size).init_process_groups()
    ddp, opt, _ = _run(cfg, ps, 3, overlap=False, bucket_size=1500, optimizer_state_dtype=state_dtype,
                       master_weight_dtype="fp16" if state_dtype == "fp8" else "fp32")
    torch.save(opt.state_dict(), os.path.join(directory, f"dp{world_size}_rank{rank}.pt"))
    train_step(ddp, opt, cfg, 3, LR, sequences=RESHARD_SEQUENCES)
    if rank == 0:
        torch.save(_params(ddp.module), os.path.join(directory, f"dp{world_size}_next.pt"))


def _load_body(rank, world_size, directory, saved_world, state_dtype):
    cfg = tiny_config()
    ps = ParallelState(world_size=world_size).init_process_groups()
    model = build(cfg, ps, seed=123)  # different weights: everything must come from the checkpoint
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, bucket_size=700)
    opt = DistributedOptimizer(ddp, weight_decay=WD, clip_grad=CLIP, optimizer_state_dtype=state_dtype,
                               master_weight_dtype="fp16" if state_dtype == "fp8" else "fp32")
    opt.load_state_dict([torch.load(os.path.join(directory, f"dp{saved_world}_rank{r}.pt")) for r in range(saved_world)])
    assert opt.step_count == 3
    train_step(ddp, opt, cfg, 3, LR, sequences=RESHARD_SEQUENCES)
    expected = torch.load(os.path.join(directory, f"dp{saved_world}_next.pt"))
    for name, value in _params(ddp.module).items():
        assert max_rel_diff(value, expected[name]) <= 1e-5, (name, max_rel_diff(value, expected[name]))


@pytest.mark.distributed
@pytest.mark.parametrize("state_dtype", [pytest.param("fp32", marks=pytest.mark.slow), "fp8"])
def test_save_at_dp4_load_at_dp2(tmp_path, state_dtype):
    run_distributed(_save_body, world_size=4, args=(str(tmp_path), state_dtype), timeout_s=600)
    run_distributed(_load_body, world_size=2, args=(str(tmp_path), 4, state_dtype), timeout_s=600)


def _tensor_parallel_body(rank, world_size):
    """TP=2 x DP=2 with sequence parallelism: norm grads are summed over TP exactly once (in their bucket's
    reduction) and the clipped global norm counts the TP-replicated norms once, so the run equals AdamW on
    the unsharded model: as close to an fp64 TP=1 run as the fp32 TP=1 run is (rounding only)."""
    cfg = tiny_config()
    reference = build(cfg, ParallelState().init_process_groups())
    full_state = {k: v.clone() for k, v in reference.state_dict().items()}
    exact = copy.deepcopy(reference).double()
    ref_opt, exact_opt = reference_adamw(reference, LR, WD), reference_adamw(exact, LR, WD)
    for step in range(STEPS):
        reference_step(reference, ref_opt, cfg, step, 2, CLIP)
        reference_step(exact, exact_opt, cfg, step, 2, CLIP)
    ps = ParallelState(world_size=world_size, tensor_model_parallel_size=2, sequence_parallel=True).init_process_groups()
    model = build(cfg, ps)
    model.load_state_dict(shard_state_dict(full_state, model, 2, ps.tp_group.rank))
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=1000)
    opt = DistributedOptimizer(ddp, weight_decay=WD, clip_grad=CLIP)
    for step in range(STEPS):
        assert not train_step(ddp, opt, cfg, step, LR)[0].skipped
    ref, fp64 = dict(reference.named_parameters()), dict(exact.named_parameters())
    tp1_errors, tp2_errors = {}, {}
    for name, param in model.named_parameters():
        full = gather_tensor_model_parallel(param.detach(), param, ps.tp_group)
        expected, exact_value = ref[name].detach(), fp64[name].detach()
        if getattr(param, "padded_vocab", False):  # padding differs between TP layouts; rows past the vocab are unused
            full, expected, exact_value = full[: cfg.vocab_size], expected[: cfg.vocab_size], exact_value[: cfg.vocab_size]
        tp1_errors[name], tp2_errors[name] = max_rel_diff(expected, exact_value), max_rel_diff(full, exact_value)
        assert max_rel_diff(full, expected) <= 3e-5, (name, max_rel_diff(full, expected))
    # Rounding only: against the fp64 run, 10 Adam steps amplify a gradient's last bits in the FFN weights (the
    # worst element of a tensor, measured: linear_fc1 of layer 0 TP=1 1.3e-5 / TP=2xSP 2.7e-6, of layer 1 5.1e-6 /
    # 1.5e-5), so which run is closer to fp64 is luck per tensor, and TP=2xSP lands up to ~1e-5 from TP=1
    # depending on the CPU's reduction order. Over the whole model the sharded run is as accurate as TP=1.
    assert max(tp2_errors.values()) <= 2 * max(tp1_errors.values()), (tp2_errors, tp1_errors)


@pytest.mark.distributed
def test_tensor_and_sequence_parallel_replicated_params():
    run_distributed(_tensor_parallel_body, world_size=4, timeout_s=600)


def _pipeline_body(rank, world_size):
    """PP=2 x DP=2, tied embeddings split over the stages, torch's 1F1B schedule running every micro-batch's
    backward (num_microbatches instead of no_sync): the tied copies are summed over the embedding group once
    (after backward, no deadlock), the norm counts them once, and the run equals AdamW at PP=1."""
    cfg = tiny_config(tie_embeddings=True, num_layers=2)
    micro, dp = 4, 2
    reference = build_pipeline(cfg, ParallelState().init_process_groups(), micro_batch_size=1,
                               num_microbatches=micro * dp, split_weight_grads=False)
    ref_opt = reference_adamw(reference.modules, LR, WD)
    ps = ParallelState(world_size=world_size, pipeline_model_parallel_size=2,
                       pipeline_schedule="1f1b").init_process_groups()
    pipe = build_pipeline(cfg, ps, micro_batch_size=1, num_microbatches=micro, split_weight_grads=False,
                          reduce_replicated_grads=False)
    ddp = make_ddp(pipe.modules, ps, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=1000)
    ddp.num_microbatches = micro
    opt = DistributedOptimizer(ddp, weight_decay=WD, clip_grad=CLIP)
    for step in range(4):
        ids, labels = global_batch(cfg, step, micro * dp)
        reference.zero_grad()
        reference.step(ids, labels)
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), CLIP)
        ref_opt.step()
        opt.zero_grad()
        mine = slice(ps.dp_group.rank * micro, (ps.dp_group.rank + 1) * micro)
        pipe.step(ids[mine], labels[mine])
        assert not opt.step(LR).skipped
    ddp.finish_param_sync()
    ref = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        expected = ref["embedding.weight" if getattr(param, "shared_embedding", False) else name].detach()
        assert max_rel_diff(param.detach(), expected) <= 1e-5, (name, max_rel_diff(param.detach(), expected))


@pytest.mark.distributed
def test_pipeline_tied_embedding():
    run_distributed(_pipeline_body, world_size=4, timeout_s=600)
