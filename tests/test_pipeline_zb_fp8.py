"""Zero-bubble schedules that split the FP8 weight gradient (megafp8/fp8/deferred_wgrad.py) under the DDP grad
buffer with --overlap-grad-reduce, at PP=2: every ZB schedule's main_grad, under every FP8 recipe, equals the same layout with the split
off bit for bit (the same GEMMs on the same FP8 operands, each added once: a doubled or lost wgrad cannot pass),
is >= 40 dB from the PP=1 FP8 run, and each bucket's overlapped reduction starts only once its main_grad is
final (no W pass adds to it afterwards). TP=2 x PP=2 with sequence parallelism (x^T gathered over TP in W) against
PP=1 (tests/pipeline_testing.py). Then through the training entry with its default flags: every ZB
schedule trains like 1F1B (FP8 delayed losses within 1e-3), and ZBV like 1F1B under the distributed optimizer with
overlapped grad reduce, overlapped FP8 param gather."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_fixtures import write_synthetic_dataset
from distributed_testing import run_distributed
from fp8_testing import sqnr_db
from megafp8.fp8 import Fp8Recipe
from megafp8.parallel.data_parallel import DDPConfig, DistributedDataParallel
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import build_pipeline
from megafp8.training.megatron_flags import LLAMA_FLAGS
from pipeline_testing import Case, config

ZB_CASES = [Case(schedule="interleaved-zb", vpp=1, fp8=True), Case(schedule="zbv", tie=True, fp8=True),
            Case(schedule="dualpipev", fp8=True, recompute="full")]
MICRO = 4
RECIPES = {"delayed": Fp8Recipe.delayed, "tensorwise": Fp8Recipe.tensorwise, "rowwise": Fp8Recipe.rowwise,
           "blockwise": Fp8Recipe.blockwise}


def _main_grads(case: Case, world_size: int, ids: torch.Tensor, split: bool, recipe: str):
    cfg = config(case)
    ps = ParallelState(world_size=world_size, pipeline_model_parallel_size=2, pipeline_schedule=case.schedule,
                       num_layers_per_virtual_pipeline_stage=case.vpp).init_process_groups()
    pipe = build_pipeline(cfg, ps, micro_batch_size=1, num_microbatches=MICRO, fp8_recipe=RECIPES[recipe](),
                          split_weight_grads=split, reduce_replicated_grads=False)
    ddp = DistributedDataParallel(pipe.modules, ps, DDPConfig(overlap_grad_reduce=True, num_microbatches=MICRO,
                                                              bucket_size=2000))
    at_start: dict[str, torch.Tensor] = {}
    real_start = ddp._start_grad_reduce

    def recording_start(bucket):  # what each bucket's main_grad holds when its reduction starts
        for p in bucket.params:
            at_start[ddp.param_names[p]] = p.main_grad.clone()
        real_start(bucket)
    ddp._start_grad_reduce = recording_start
    for _ in range(2):  # step 2 runs at delayed scales
        ddp.zero_grad_buffer()
        at_start.clear()
        pipe.step(ids, ids.roll(-1, dims=1))
        ddp.finish_grad_sync()
    grads = {name: p.main_grad.clone() for name, p in pipe.named_parameters()}
    if split:
        assert pipe.deferrals and all(d.peak_bytes > 0 for d in pipe.deferrals), "no wgrad was deferred"
        for name, grad in grads.items():
            assert torch.equal(at_start[name], grad), f"{case}: {name} changed after its bucket's reduction began"
    return grads


def _split_body(rank: int, world_size: int) -> None:
    for case in ZB_CASES:
        for recipe in RECIPES:  # every ZB schedule x every FP8 recipe
            cfg = config(case)
            ids = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_length), generator=torch.Generator().manual_seed(3))
            reference = build_pipeline(cfg, ParallelState().init_process_groups(), micro_batch_size=1,
                                       num_microbatches=MICRO, fp8_recipe=RECIPES[recipe]())
            for _ in range(2):
                reference.zero_grad()
                reference.step(ids, ids.roll(-1, dims=1))
            ref = dict(reference.named_parameters())
            split = _main_grads(case, world_size, ids, split=True, recipe=recipe)
            unsplit = _main_grads(case, world_size, ids, split=False, recipe=recipe)
            for name, grad in split.items():
                assert torch.equal(grad, unsplit[name]), f"{case} {recipe}: {name} split != unsplit"
                want = ref["embedding.weight" if case.tie and name == "output_layer.weight" else name].grad
                assert sqnr_db(grad, want) >= 40, (str(case), recipe, name, sqnr_db(grad, want))


@pytest.mark.distributed
def test_zero_bubble_fp8_split_matches_unsplit_and_pp1():
    run_distributed(_split_body, world_size=2, timeout_s=600)


ENTRY = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--num-layers", "4",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "1", "--train-iters", "3",
         "--eval-iters", "0", "--log-interval", "1", "--distributed-timeout-minutes", "1", "--fp8-format", "hybrid",
         "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--pipeline-model-parallel-size", "2"]
ZERO = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--fp8-param-gather"]
ENTRY_RUNS = {"1f1b": [], "interleaved-zb": ["--num-layers-per-virtual-pipeline-stage", "1"], "zbv": [],
              "dualpipev": [], "1f1b+zero": ZERO, "zbv+zero": ZERO}  # ZeRO: FP8 param gather, overlapped reduce


def _entry_body(rank: int, world_size: int, prefix: str, out: str) -> None:
    from megafp8.training.arguments import parse_args
    from megafp8.training.data_setup import tokenizer_vocab_size
    from megafp8.training.model_setup import model_config_from_args, parallel_state_from_args
    from megafp8.training.run import run

    for schedule, flags in ENTRY_RUNS.items():
        args = parse_args([*ENTRY, "--pipeline-schedule", schedule.split("+")[0], *flags, "--data-path", prefix,
                           "--log-dir", f"{out}/{schedule}"], world_size)
        assert run(args, parallel_state_from_args(args), model_config_from_args(args, tokenizer_vocab_size(args))) == 0


def _losses(log_dir: Path) -> list[float]:
    return [r["lm_loss"] for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())
            if "lm_loss" in r]


@pytest.mark.distributed
def test_training_entry_zero_bubble_fp8_trains_like_1f1b(tmp_path):
    prefix = str(tmp_path / "synthetic_text_document")
    write_synthetic_dataset(prefix, [40] * 60, vocab_size=300)
    run_distributed(_entry_body, world_size=2, args=(prefix, str(tmp_path / "runs")), timeout_s=600)
    for schedule in ENTRY_RUNS:
        reference = _losses(tmp_path / "runs" / ("1f1b+zero" if schedule.endswith("+zero") else "1f1b"))
        assert len(reference) == 3
        losses = _losses(tmp_path / "runs" / schedule)
        assert len(losses) == 3, schedule
        for got, want in zip(losses, reference):
            assert abs(got - want) <= 1e-3 * abs(want), (schedule, losses, reference)


def _sequence_parallel_body(rank: int, world_size: int) -> None:
    from pipeline_testing import run_case

    # TP=2 x PP=2, SP: the deferred wgrad of a column-parallel layer gathers its x^T shard over TP in W.
    pipe = run_case(Case(pp=2, tp=2, sp=True, fp8=True, schedule="zbv"), world_size)
    assert pipe.deferrals and all(d.peak_bytes > 0 for d in pipe.deferrals)


@pytest.mark.distributed
def test_zero_bubble_fp8_split_under_sequence_parallel_matches_pp1():
    run_distributed(_sequence_parallel_body, world_size=4, timeout_s=600)
