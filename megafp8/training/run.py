"""One rank's run once the flags are known to be good: process groups, this rank's pipeline chunks, the
data-parallel grad buffer, the ZeRO optimizer, a checkpoint to resume from, then the training loop."""
from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch

from megafp8.checkpoint import CheckpointError
from megafp8.fp8 import Fp8Recipe
from megafp8.model import ModelConfig
from megafp8.optim import DistributedOptimizer
from megafp8.parallel.data_parallel import DDPConfig, DistributedDataParallel
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import build_pipeline
from megafp8.training.checkpointing import Checkpointer
from megafp8.training.train import Trainer, TrainProgress, saturation_guard


def build_training_state(args: argparse.Namespace, parallel_state: ParallelState, config: ModelConfig):
    """(pipeline, ddp, optimizer) of this rank."""
    recipe = Fp8Recipe.from_args(args)
    pipeline = build_pipeline(config, parallel_state, micro_batch_size=args.micro_batch_size,
                              num_microbatches=args.num_micro_batches, fp8_recipe=recipe,
                              first_last_layers_bf16=args.first_last_layers_bf16,
                              # The grad buffer is fed by post-accumulate-grad hooks, which a split
                              # weight-gradient pass would bypass.
                              split_weight_grads=False, reduce_replicated_grads=False)
    ddp = DistributedDataParallel(pipeline.modules, parallel_state, DDPConfig.from_args(args, recipe))
    ddp.num_microbatches = args.num_micro_batches  # the schedule runs every backward: overlap on the last one
    optimizer = DistributedOptimizer(ddp, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                     weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                                     master_weight_dtype=args.master_weight_dtype,
                                     optimizer_state_dtype=args.optimizer_state_dtype)
    return pipeline, ddp, optimizer


def run(args: argparse.Namespace, parallel_state: ParallelState, config: ModelConfig) -> int:
    parallel_state.init_process_groups(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    torch.manual_seed(args.seed)  # data-independent randomness; parameters come from (seed, name) generators
    pipeline, ddp, optimizer = build_training_state(args, parallel_state, config)
    fp8 = Fp8Recipe.from_args(args) is not None
    guard = None
    if fp8 and args.fp8_saturation_guard:
        guard = saturation_guard(parallel_state, args.fp8_saturation_guard_threshold, args.fp8_saturation_guard_patience)
    checkpointer = Checkpointer(args, parallel_state, pipeline, optimizer, guard) if args.save or args.load else None
    progress = None
    if args.load:
        try:
            saved = checkpointer.load()
        except CheckpointError as e:
            if parallel_state.rank == 0:
                print(f"megafp8-pretrain: error: {e}", file=sys.stderr, flush=True)
            return 2
        progress = TrainProgress(**saved) if saved else None
    trainer = Trainer(args, parallel_state, pipeline, ddp, optimizer, guard, progress,
                      checkpointer if args.save else None)
    progress = trainer.train()
    if trainer.is_logging_rank:
        print(f"megafp8: trained {progress.iteration} iterations ({progress.consumed_samples} samples, "
              f"{progress.skipped_iterations} skipped)", flush=True)
    return 0
