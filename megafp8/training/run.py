"""One rank's run once the flags are known to be good: process groups, this rank's pipeline chunks, the
data-parallel grad buffer, the ZeRO optimizer, a checkpoint to resume from, then the training loop."""
from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megafp8.checkpoint.errors import CheckpointError
from megafp8.fp8 import Fp8Recipe
from megafp8.fp8.kurtosis import KurtosisWarning
from megafp8.model import ModelConfig
from megafp8.model.compile import compile_report
from megafp8.optim import DistributedOptimizer
from megafp8.optim.loss_scaler import loss_scaler_from_args
from megafp8.parallel.data_parallel import DDPConfig, DistributedDataParallel
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import build_pipeline
from megafp8.training.compilation import apply_compile
from megafp8.training.data_setup import close_batches
from megafp8.training.rerun import RerunExit
from megafp8.training.train import Trainer, TrainProgress, saturation_guard

# What --decoupled-lr steps (Megatron's is_embedding_or_output_parameter): the input embedding and the output layer,
# by global name. A tied head is the embedding (V schedules: the same Parameter, named embedding.weight); its
# last-stage copy under PP (output_layer.weight) takes the same LR, so the two copies stay equal.
DECOUPLED_LR_PARAMS = ("embedding.weight", "output_layer.weight")


def _recipe_words(recipe: Fp8Recipe) -> str:
    """The banner's name of the run's recipe: FP8 e4m3 delayed, MXFP8 e4m3, NVFP4 (stochastic rounding, ...)."""
    if recipe.element_bits == 4:
        parts = [name for name, on in (("stochastic rounding", recipe.fp4_stochastic_rounding),
                                       ("Hadamard wgrad", recipe.fp4_hadamard),
                                       ("16x16 weights", recipe.fp4_weight_2d and recipe.scaling == "nvfp4")) if on]
        return f"FP4 e2m1 {recipe.scaling}" + (f" ({', '.join(parts)})" if parts else "")
    if recipe.is_microscaled:
        return f"{recipe.scaling.upper()} {recipe.fp8_format} (E8M0 scale per 32, {recipe.mx_scale_rounding})"
    return f"FP8 {recipe.fp8_format} {recipe.scaling}"


def build_training_state(args: argparse.Namespace, parallel_state: ParallelState, config: ModelConfig,
                         device: torch.device | str | None = None):
    """(pipeline, ddp, optimizer) of this rank, on `device` (default: this rank's GPU, else the CPU; "meta" for
    tools/bench/bench_host_overhead.py, which times the host's work of a step without any compute)."""
    recipe = Fp8Recipe.from_args(args)
    pipeline = build_pipeline(config, parallel_state, micro_batch_size=args.micro_batch_size,
                              num_microbatches=args.num_micro_batches, fp8_recipe=recipe,
                              first_last_layers_bf16=args.first_last_layers_bf16,
                              # The default split: FP8 wgrads in the zero-bubble W pass (they feed the grad
                              # buffer's hooks there); without FP8 no split (torch's W would bypass those hooks).
                              reduce_replicated_grads=False, device=device)
    pipeline.calculate_per_token_loss = args.calculate_per_token_loss
    ddp = DistributedDataParallel(pipeline.modules, parallel_state, DDPConfig.from_args(args, recipe))
    ddp.num_microbatches = args.num_micro_batches  # the schedule runs every backward: overlap on the last one
    optimizer = DistributedOptimizer(ddp, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                     weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                                     master_weight_dtype=args.master_weight_dtype,
                                     optimizer_state_dtype=args.optimizer_state_dtype, rounding_seed=args.seed,
                                     decoupled_lr_params=DECOUPLED_LR_PARAMS if args.decoupled_lr is not None else ())
    optimizer.loss_scaler = loss_scaler_from_args(args, ddp.grad_buffers[0].device)
    if optimizer.loss_scaler is not None:  # the pipeline scales the losses by the tensor the optimizer's update moves
        pipeline.loss_scale = optimizer.loss_scaler.scale
    return pipeline, ddp, optimizer


def parameter_counts(pipeline, parallel_state: ParallelState) -> tuple[int, list[int]]:
    """(the model's parameters, the parameters each pipeline rank holds), summed over the TP shards (padded
    vocabulary rows included); a tied embedding's copy on the last stage counts for its stage, not twice in the
    total. Every rank calls (one all_gather_object over the world, once per run)."""
    params = list(pipeline.parameters())
    held = sum(p.numel() for p in params)
    own = sum(p.numel() for p in params if not getattr(p, "shared_embedding", False))
    coords = parallel_state.coords
    entry = (coords.pp, coords.dp == 0 and coords.cp == 0, held, own)  # DP and CP replicas hold the same parameters
    gathered = [entry]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entry)
    per_stage = [0] * parallel_state.pp_size
    total = 0
    for stage, first_replica, stage_held, stage_own in gathered:
        if first_replica:
            per_stage[stage] += stage_held
            total += stage_own
    return total, per_stage


def startup_banner(args: argparse.Namespace, parallel_state: ParallelState, total_params: int,
                   per_stage: list[int]) -> list[str]:
    """What this run is, in a few lines (as Megatron and torchtitan print it): layout, size, tokens, FP8, outputs."""
    ps = parallel_state
    layout = (f"TP {ps.tp_size} x CP {ps.cp_size} x PP {ps.pp_size} x DP {ps.dp_size} = {ps.world_size} process{'es' if ps.world_size > 1 else ''}"
              + (", sequence parallel" if args.sequence_parallel else "")
              + (f", schedule {ps.pipeline_schedule}" if ps.pp_size > 1 else "")
              + (f", {args.num_layers_per_virtual_pipeline_stage} layers per virtual stage"
                 if args.num_layers_per_virtual_pipeline_stage else ""))
    params = f"{total_params:,}" + (f" (per pipeline rank: {' | '.join(f'{n:,}' for n in per_stage)})"
                                    if ps.pp_size > 1 else "")
    recipe = Fp8Recipe.from_args(args)
    if recipe is None:
        half = "bf16" if args.bf16 else "fp16" if args.fp16 else None
        precision = (half if torch.cuda.is_available() else f"fp32 (--{half}: on GPU only)") if half else \
            "fp32 (no --fp8-format)"
    else:
        precision = (_recipe_words(recipe)
                     + (f" (amax history {recipe.amax_history_len}, {recipe.amax_compute_algo})" if recipe.is_delayed else "")
                     + (f", first/last {args.first_last_layers_bf16} layers high precision" if args.first_last_layers_bf16 else "")
                     + (f", saturation guard at {args.fp8_saturation_guard_threshold:g} x {args.fp8_saturation_guard_patience}"
                        if args.fp8_saturation_guard else ", saturation guard off"))
    if args.fp16:
        precision += (f", loss scale {args.loss_scale:.10g} (constant)" if args.loss_scale is not None else
                      f", dynamic loss scale from {args.initial_loss_scale:.10g} (window {args.loss_scale_window}, "
                      f"hysteresis {args.hysteresis}, min {args.min_loss_scale:g})")
    outputs = [f"{name} {path}" for name, path in (
        ("checkpoints", args.save), ("metrics", args.log_dir and f"{args.log_dir}/metrics.jsonl"),
        ("tensorboard", args.tensorboard_dir),
        ("wandb project", getattr(args, "wandb_project", None))) if path]
    train_iters = -(-args.train_samples // args.global_batch_size)
    return [
        f"megafp8: layout {layout}",
        f"megafp8: batch {args.global_batch_size} samples per iteration = {args.num_micro_batches} micro-batches of "
        f"{args.micro_batch_size} x DP {ps.dp_size}; {args.global_batch_size * args.seq_length:,} tokens per "
        f"iteration, {train_iters} iterations",
        f"megafp8: parameters {params}",
        f"megafp8: precision {precision}",
        f"megafp8: outputs {', '.join(outputs) if outputs else 'none (no --save, --log-dir or --tensorboard-dir)'}",
    ]


def wandb_settings(args: argparse.Namespace) -> dict:
    """TrainingLog.start_wandb's arguments from Megatron's flags. The run directory is --wandb-save-dir, else
    <--save>/wandb (Megatron's default), else wandb's own (./wandb); the run's config is every flag. The rank that
    writes TensorBoard (the last pipeline stage's first) writes it: the loss is there."""
    save_dir = getattr(args, "wandb_save_dir", None) or (os.path.join(args.save, "wandb") if args.save else None)
    return {"project": args.wandb_project, "name": getattr(args, "wandb_exp_name", None), "save_dir": save_dir,
            "config": dict(vars(args))}


def run(args: argparse.Namespace, parallel_state: ParallelState, config: ModelConfig) -> int:
    parallel_state.init_process_groups(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    if args.fp8_gemm_autotune:  # else every rank launches the audited default config (megafp8_kernels.gemm: why)
        from megafp8_kernels.gemm import AUTOTUNE_ENV_VAR

        os.environ[AUTOTUNE_ENV_VAR] = "1"
    torch.manual_seed(args.seed)  # data-independent randomness; parameters come from (seed, name) generators
    pipeline, ddp, optimizer = build_training_state(args, parallel_state, config)
    compiled = apply_compile(args, pipeline.chunks)
    total_params, per_stage = parameter_counts(pipeline, parallel_state)
    if parallel_state.rank == 0:
        print("\n".join(startup_banner(args, parallel_state, total_params, per_stage)), flush=True)
    fp8 = Fp8Recipe.from_args(args) is not None
    guard = None
    if fp8 and args.fp8_saturation_guard:
        guard = saturation_guard(parallel_state, args.fp8_saturation_guard_threshold, args.fp8_saturation_guard_patience,
                                 read_interval=args.log_interval)
        if args.fp8_saturation_guard_kurtosis:  # before a resume, which restores the warning's windows into it
            guard.kurtosis_warning = KurtosisWarning(args.kurtosis_warning_ratio, args.kurtosis_warning_window)
    checkpointer = None
    if args.save or args.load:  # torch.distributed.checkpoint is imported only by runs that use it
        from megafp8.training.checkpointing import Checkpointer

        checkpointer = Checkpointer(args, parallel_state, pipeline, optimizer, guard)
    progress = None
    if args.load:  # the newest of --load's and the non-persistent checkpoints (Megatron-LM: with --load only)
        try:
            saved = checkpointer.resume()
        except CheckpointError as e:
            if parallel_state.rank == 0:
                print(f"megafp8-pretrain: error: {e}", file=sys.stderr, flush=True)
            return 2
        progress = TrainProgress(**saved) if saved else None
    trainer = Trainer(args, parallel_state, pipeline, ddp, optimizer, guard, progress,
                      checkpointer if args.save else None)
    if trainer.is_logging_rank and getattr(args, "wandb_project", None):
        trainer.log.start_wandb(**wandb_settings(args))
    try:
        progress = trainer.train()
    except RerunExit as e:  # a suspicious step's re-run decided to stop (megafp8.training.rerun): every rank
        if parallel_state.rank == 0:
            print(f"megafp8-pretrain: stopping: {e} (exit {e.code})", file=sys.stderr, flush=True)
        return e.code
    finally:  # --num-workers' processes end with the run, also when it fails
        close_batches(trainer.train_batches, trainer.valid_batches)
    if trainer.is_logging_rank and compiled:
        print(f"megafp8: {compile_report().line()}", flush=True)
    if trainer.is_logging_rank:
        print(f"megafp8: trained {progress.iteration} iterations ({progress.consumed_samples} samples, "
              f"{progress.skipped_iterations} skipped)", flush=True)
    return 0
