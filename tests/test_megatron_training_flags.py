"""Megatron-LM's training-loop flags with Megatron's meaning: --calculate-per-token-loss (the gradient and the logged
loss of the global batch's token mean, over uneven loss masks at DP=2 and PP=2 x DP=2), --decoupled-lr/-min-lr (the
embedding and output layer on their own schedule, in the ZeRO optimizer's torch and fused steps, vs torch AdamW with
two LRs in fp64), --lr-warmup-fraction (a hand-computed schedule), --manual-gc and --empty-unused-memory-level."""
from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from distributed_testing import run_distributed
from optim_testing import build, local_micro_batches, make_ddp, max_rel_diff, tiny_config
from megafp8.model import GPTModel
from megafp8.optim import DistributedOptimizer
from megafp8.optim.lr_schedule import LearningRateSchedule
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.arguments import parse_and_check
from megafp8.training.data_setup import batches, build_datasets, close_batches, tokenizer_from_args
from megafp8.training.megatron_flags import LLAMA_FLAGS
from megafp8.training.model_setup import model_config_from_args, parallel_state_from_args
from megafp8.training.run import DECOUPLED_LR_PARAMS
from megafp8.training.train import Trainer, decoupled_learning_rate_schedule, learning_rate_schedule

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500",
         "--mock-data", *LLAMA_FLAGS]


def _args(*flags: str, world_size: int = 1):
    args, errors, _ = parse_and_check([*MODEL, *flags], world_size)
    assert errors == [], errors
    return args


def _errors(*flags: str) -> list[str]:
    return parse_and_check([*MODEL, *flags], 1)[1]


# ---- --lr-warmup-fraction -------------------------------------------------------------------------------------
def test_warmup_fraction_is_that_fraction_of_the_decay_length():
    # --train-iters 10 x global batch 4, decay over --lr-decay-iters 8 = 32 samples: warm-up 0.3 x 32 = 9.6 samples
    # (Megatron's lr_warmup_steps = fraction x lr_decay_steps, not rounded), then linear to --min-lr
    schedule = learning_rate_schedule(_args("--train-iters", "10", "--global-batch-size", "4", "--lr-decay-iters", "8",
                                            "--lr-warmup-fraction", "0.3", "--min-lr", "1e-4",
                                            "--lr-decay-style", "linear"))
    expected = {0: 0.0, 4: 1e-3 * 4 / 9.6, 8: 1e-3 * 8 / 9.6, 12: 1e-4 + 9e-4 * (1 - (12 - 9.6) / 22.4),
                28: 1e-4 + 9e-4 * (1 - (28 - 9.6) / 22.4), 32: 1e-4, 36: 1e-4}
    assert {s: schedule(s) for s in expected} == pytest.approx(expected, rel=1e-12, abs=0)
    # counted in samples: the decay length defaults to --train-samples
    schedule = learning_rate_schedule(_args("--train-samples", "50", "--lr-warmup-fraction", "0.1",
                                            "--lr-decay-style", "constant"))
    assert schedule.warmup_samples == pytest.approx(5.0) and schedule(2) == pytest.approx(1e-3 * 2 / 5)


@pytest.mark.parametrize("flags, message", [
    (["--lr-warmup-fraction", "1"], "--lr-warmup-fraction must be in [0, 1), got 1.0"),
    (["--lr-warmup-fraction", "-0.1"], "--lr-warmup-fraction must be in [0, 1), got -0.1"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction and --lr-warmup-iters"),
    (["--decoupled-min-lr", "1e-4"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--decoupled-lr", "1e-4", "--decoupled-min-lr", "2e-4"], "--decoupled-min-lr 0.0002 exceeds --decoupled-lr"),
    (["--decoupled-lr", "1e-5", "--min-lr", "1e-4"], "--min-lr (the floor without --decoupled-min-lr) 0.0001 exceeds"),
    (["--manual-gc-interval", "2"], "--manual-gc-interval needs --manual-gc"),
])
def test_bad_schedule_and_gc_flags_are_refused_in_one_line(flags, message):
    errors = _errors("--train-iters", "10", *flags)
    assert any(message in e for e in errors), errors
    assert not any("--lr-warmup-iters/-samples) must be shorter" in e for e in errors), errors  # not the wrong flag


# ---- --decoupled-lr: the schedule ------------------------------------------------------------------------------
@pytest.mark.parametrize("decoupled_min_lr", [None, 2e-5])
def test_decoupled_schedule_equals_megatron_cores_param_group(decoupled_min_lr):
    """Megatron's OptimizerParamScheduler with the param-group override megatron.core.optimizer gives the embedding
    and output layer ({max_lr: decoupled_lr, min_lr: decoupled_min_lr if given}), step for step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    flags = ["--train-iters", "40", "--global-batch-size", "4", "--lr", "3e-4", "--min-lr", "3e-5",
             "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.1", "--decoupled-lr", "1e-3"]
    if decoupled_min_lr is not None:
        flags += ["--decoupled-min-lr", str(decoupled_min_lr)]
    args = _args(*flags)
    main, decoupled = learning_rate_schedule(args), decoupled_learning_rate_schedule(args)
    override = {"max_lr": 1e-3} if decoupled_min_lr is None else {"max_lr": 1e-3, "min_lr": decoupled_min_lr}
    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                                 {"params": [torch.nn.Parameter(torch.zeros(1))], **override}], lr=0.0)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=0.1 * 160,
                                        lr_decay_steps=160, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=1, wd_incr_style="constant")
    ours, megatron = [], []
    for iteration in range(45):
        ours += [main(iteration * 4), decoupled(iteration * 4)]
        megatron += [group["lr"] for group in optimizer.param_groups]
        scheduler.step(increment=4)
    assert ours == pytest.approx(megatron, rel=1e-12, abs=0)
    assert decoupled(160) == (3e-5 if decoupled_min_lr is None else decoupled_min_lr)
    assert decoupled_learning_rate_schedule(_args("--train-iters", "4")) is None


# ---- --decoupled-lr: the optimizer -----------------------------------------------------------------------------
WD = 0.1
SCHEDULE = LearningRateSchedule(max_lr=1e-3, min_lr=1e-4, warmup_samples=2, decay_samples=6, decay_style="cosine")
DECOUPLED = dataclasses.replace(SCHEDULE, max_lr=8e-3, min_lr=5e-4)  # 8x: a wrong routing is far off
STEPS = 6


def _adamw_two_lrs(model):
    """torch.optim.AdamW as Megatron groups the parameters: decay / no decay, and the decoupled-LR group."""
    groups = {"decoupled": [], "decay": [], "no_decay": []}
    for name, p in model.named_parameters():
        groups["decoupled" if name in DECOUPLED_LR_PARAMS else "decay" if p.dim() >= 2 else "no_decay"].append(p)
    return torch.optim.AdamW([{"params": groups["decoupled"], "weight_decay": WD, "decoupled": True},
                              {"params": groups["decay"], "weight_decay": WD, "decoupled": False},
                              {"params": groups["no_decay"], "weight_decay": 0.0, "decoupled": False}], lr=0.0)


def _decoupled_body(rank: int, world_size: int, fused: bool, tie: bool) -> None:
    cfg = tiny_config(tie_embeddings=tie)
    ps = ParallelState(world_size=world_size).init_process_groups()
    reference = build(cfg, ParallelState().init_process_groups()).double()  # fp64 weights and AdamW
    ref_opt = _adamw_two_lrs(reference)
    model = build(cfg, ps)
    # small buckets: the embedding shares one with other parameters and DP shards cut through it
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, bucket_size=2000)
    opt = DistributedOptimizer(ddp, weight_decay=WD, fused_step=fused, decoupled_lr_params=DECOUPLED_LR_PARAMS)
    micro_batches = 2
    for step in range(STEPS):
        lr, decoupled_lr = SCHEDULE(step), DECOUPLED(step)
        # the reference: the DP run's loss (mean over ranks and micro-batches of the micro-batch means)
        ref_opt.zero_grad()
        for ids, labels in local_micro_batches(cfg, step, 1, 0, sequences=world_size * micro_batches * 2):
            (reference(ids, labels).double().mean() / (micro_batches * world_size)).backward()
        for group in ref_opt.param_groups:
            group["lr"] = decoupled_lr if group["decoupled"] else lr
        ref_opt.step()
        opt.zero_grad()
        batch = local_micro_batches(cfg, step, world_size, rank)
        for i, (ids, labels) in enumerate(batch):
            with ddp.no_sync() if i < len(batch) - 1 else _nothing():
                (ddp(ids, labels).mean() / len(batch)).backward()
        assert not opt.step(lr, decoupled_lr=decoupled_lr).skipped
    ddp.finish_param_sync()
    ref = dict(reference.named_parameters())
    assert set(ref) >= set(DECOUPLED_LR_PARAMS[:1 if tie else 2])
    for name, value in ddp.module.named_parameters():
        assert max_rel_diff(value.detach(), ref[name].detach()) <= 1e-5, (name, max_rel_diff(value, ref[name]))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("fused", [False, True], ids=["twin", "fused"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_decoupled_lr_matches_adamw_with_two_param_groups_dp1(fused, tie):
    _decoupled_body(0, 1, fused, tie)


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [pytest.param(False, marks=pytest.mark.slow), True], ids=["twin", "fused"])
def test_decoupled_lr_matches_adamw_with_two_param_groups_dp2(fused):
    run_distributed(_decoupled_body, world_size=2, args=(fused, False), timeout_s=600)


def test_fused_and_twin_steps_agree_bit_for_bit_with_two_lrs():
    """The fused step cuts each shard where the LR changes; every element gets the twin's bits."""
    cfg = tiny_config()
    results = []
    for fused in (False, True):
        ps = ParallelState().init_process_groups()
        ddp = make_ddp(build(cfg, ps), ps, use_distributed_optimizer=True, bucket_size=2000)
        opt = DistributedOptimizer(ddp, weight_decay=WD, clip_grad=0.5, fused_step=fused,
                                   decoupled_lr_params=DECOUPLED_LR_PARAMS)
        for step in range(3):
            opt.zero_grad()
            for ids, labels in local_micro_batches(cfg, step, 1, 0):
                ddp(ids, labels).mean().backward()
            opt.step(SCHEDULE(step + 2), decoupled_lr=DECOUPLED(step + 2))
        ddp.finish_param_sync()
        results.append(opt.state_dict()["fragments"])
    for name, entry in results[0].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, results[1][name][key]), (name, key)


# ---- --calculate-per-token-loss --------------------------------------------------------------------------------
def _uneven_mask(shape, dp_rank: int) -> torch.Tensor:
    """Rank 0 keeps few of its tokens, rank 1 most, and every sequence (micro-batch row) a different share."""
    g = torch.Generator().manual_seed(11 + dp_rank)
    keep = torch.linspace(0.05, 0.3, shape[0]) if dp_rank == 0 else torch.linspace(0.6, 1.0, shape[0])
    return (torch.rand(shape, generator=g) < keep[:, None]).float()


class _UnevenMaskTrainer(Trainer):
    """The training loop with uneven loss masks per DP rank, keeping the gradients each step left in the buffer."""

    recorded: dict = {}

    def loss_mask(self, labels):
        return _uneven_mask(labels.shape, self.ps.data_parallel_rank)

    def train_step(self):
        result = super().train_step()
        _UnevenMaskTrainer.recorded = {name: p.main_grad.clone() for p, name in self.ddp.param_names.items()}
        return result


def _global_batch_of(args, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What DP rank `dp_rank` trains on at iteration 1, read again from the data."""
    train, _ = build_datasets(args)
    source = batches(train, 0, args, SimpleNamespace(data_parallel_rank=dp_rank, dp_size=dp_size))
    tokens = torch.cat([next(source) for _ in range(args.num_micro_batches)])
    close_batches(source)
    return tokens[:, :-1], tokens[:, 1:]


def _per_token_body(rank: int, world_size: int, pp: int, log_dir: str) -> None:
    import megafp8.training.run as run_module

    args = _args("--train-iters", "1", "--global-batch-size", "8", "--pipeline-model-parallel-size", str(pp),
                 "--clip-grad", "0", "--eval-iters", "0", "--calculate-per-token-loss", "--log-dir", log_dir,
                 world_size=world_size)
    config = model_config_from_args(args, tokenizer_from_args(args).vocab_size)
    run_module.Trainer = _UnevenMaskTrainer  # this process's run() builds it
    assert run_module.run(args, parallel_state_from_args(args), config) == 0
    got = _UnevenMaskTrainer.recorded

    # The reference: one process, fp64, the whole global batch: sum(loss x mask) / sum(mask).
    dp = world_size // pp
    reference = GPTModel(config, ParallelState().init_process_groups()).double()
    shares = [(*_global_batch_of(args, r, dp), r) for r in range(dp)]
    token_losses = [(reference(ids, labels).double(), _uneven_mask(labels.shape, r).double()) for ids, labels, r in shares]
    total = sum((loss * mask).sum() for loss, mask in token_losses) / sum(mask.sum() for _, mask in token_losses)
    per_rank_mean = sum((loss * mask).sum() / mask.sum() for loss, mask in token_losses) / dp  # without the flag
    grads = torch.autograd.grad(total, list(reference.parameters()), retain_graph=True)
    other = torch.autograd.grad(per_rank_mean, list(reference.parameters()))
    ref = dict(zip((n for n, _ in reference.named_parameters()), grads))
    without = dict(zip((n for n, _ in reference.named_parameters()), other))
    assert got
    for name, grad in got.items():
        ref_name = "embedding.weight" if name == "output_layer.weight" and config.tie_embeddings else name
        assert max_rel_diff(grad, ref[ref_name]) <= 1e-5, (name, max_rel_diff(grad, ref[ref_name]))
        if name.startswith("layers."):  # the masks are uneven enough that the per-rank mean is another gradient
            assert max_rel_diff(without[ref_name], ref[ref_name]) > 1e-2, name
    if rank == world_size - 1:  # the last stage logs: Megatron's lm loss, the summed losses over the summed tokens
        record = json.loads(open(f"{log_dir}/metrics.jsonl").read().splitlines()[0])
        assert record["lm_loss"] == pytest.approx(float(total), rel=1e-5)
        assert abs(float(per_rank_mean) - float(total)) > 1e-3 * float(total)  # 100x the tolerance: a real check


@pytest.mark.distributed
@pytest.mark.parametrize("pp", [pytest.param(1, marks=pytest.mark.slow), 2], ids=["dp2", "pp2_dp2"])  # pp2_dp2 has DP2
def test_per_token_loss_is_the_global_batch_token_mean(pp, tmp_path):
    run_distributed(_per_token_body, world_size=2 * pp, args=(pp, str(tmp_path)), timeout_s=600)


# ---- the flags through the training entry ----------------------------------------------------------------------
def test_training_entry_honours_the_flags(tmp_path, monkeypatch):
    """`megafp8.pretrain.main` in this process: --manual-gc turns the collector off and collects every interval and
    around evaluation; --empty-unused-memory-level 2 empties the CUDA cache after forward/backward, after the
    optimizer step and after each evaluation batch; --lr-warmup-fraction and --decoupled-lr reach the optimizer."""
    import megafp8.training.train as train_module
    from megafp8.pretrain import main

    steps: list[tuple[float, float, frozenset]] = []
    events: list[tuple] = []
    original_step = DistributedOptimizer.step

    def recording_step(self, lr, decoupled_lr=None):
        steps.append((lr, decoupled_lr, self.decoupled_lr_params))
        return original_step(self, lr, decoupled_lr=decoupled_lr)

    state = {"enabled": True}
    fake_gc = SimpleNamespace(
        isenabled=lambda: state["enabled"],
        disable=lambda: (events.append(("disable", len(steps))), state.update(enabled=False)),
        enable=lambda: (events.append(("enable", len(steps))), state.update(enabled=True)),
        collect=lambda generation=2: events.append(("collect", len(steps), generation)))
    empties = []
    monkeypatch.setattr(DistributedOptimizer, "step", recording_step)
    monkeypatch.setattr(train_module, "gc", fake_gc)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: empties.append(len(steps)))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    status = main([*MODEL, "--train-iters", "6", "--global-batch-size", "4", "--lr-decay-iters", "5",
                   "--lr-warmup-fraction", "0.3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
                   "--decoupled-lr", "5e-3", "--manual-gc", "--manual-gc-interval", "2", "--eval-interval", "3",
                   "--eval-iters", "1", "--empty-unused-memory-level", "2", "--calculate-per-token-loss",
                   "--log-dir", str(tmp_path)])
    assert status == 0
    # collector off at the start (and one collection), every 2 iterations, around the evaluations at 3 and 6
    # (all generations before, the young one after), back on at the end
    assert events == [("disable", 0), ("collect", 0, 2), ("collect", 2, 2), ("collect", 3, 2), ("collect", 3, 0),
                      ("collect", 4, 2), ("collect", 6, 2), ("collect", 6, 0), ("collect", 6, 2), ("enable", 6)]
    # level 2: before and after each of the 6 optimizer steps; level 1's once per evaluation batch
    assert empties == [0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 6, 6]

    def hand_schedule(max_lr: float, samples: int) -> float:  # warm-up 0.3 x 20 = 6 samples, cosine to 1e-4 at 20
        if samples <= 6:
            return max_lr * samples / 6
        return 1e-4 + 0.5 * (math.cos(math.pi * min(samples - 6, 14) / 14) + 1) * (max_lr - 1e-4)
    expected_lrs = [hand_schedule(1e-3, 4 * i) for i in range(6)]
    assert [lr for lr, _, _ in steps] == pytest.approx(expected_lrs, rel=1e-12, abs=0)
    assert [decoupled for _, decoupled, _ in steps] == pytest.approx([hand_schedule(5e-3, 4 * i) for i in range(6)],
                                                                     rel=1e-12, abs=0)
    assert all(names == frozenset(DECOUPLED_LR_PARAMS) for _, _, names in steps)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if "lm_loss" in r] == pytest.approx(expected_lrs, rel=1e-12, abs=0)
