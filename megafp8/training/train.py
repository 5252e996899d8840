"""The training loop: micro-batches through the model, the FP8 scaling update, the optimizer step, the
LR schedule, evaluation, logging, checkpoints and the exit conditions, on one rank of a 3D layout.

Order of one iteration (every rank), in the phases of Trainer.train_step:
    1. forward_backward: zero the grad buffer, Pipeline.forward_backward: forward/backward of each micro-batch,
       the SP/tied-embedding grad all-reduces (the FP8 amaxes stay pending);
    2. update_fp8_scales: the trainer runs the FP8 delayed-scaling update (one amax collective) right after the
       backward, before the optimizer step, and also when that step is then skipped;
    3. prepare_optimizer_step: DistributedOptimizer.prepare finishes the DP grad reduction and computes the global
       grad norm and its finite flag, touching no parameter (a StepState restore can still re-run the step);
    4. apply_optimizer_step: DistributedOptimizer.apply at lr(consumed samples), the embedding and output layer at
       --decoupled-lr's schedule (skipped on every rank if any grad is non-finite), which publishes the weights
       (FP8 ones under the scales of phase 2) -> saturation guard;
    then log / evaluate / save / exit.

An iteration that does not log asks the device nothing: the loss, the grad norm and the skipped/NaN counts
stay device tensors, read on log iterations (and before a save) by one copy of a packed tensor. The FP8
saturation guard keeps its strikes on the device too; a trip reaches the host one iteration later through a
non-blocking copy of one flag (each iteration waits for the previous iteration's copy event: the CPU runs at most
one iteration ahead, no queue drain), and only the iteration that switches a layer reads its strikes
(megafp8.fp8.telemetry.SaturationGuard).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megafp8.fp8 import Fp8Recipe, SaturationGuard, collect_fp8_telemetry, enable_fp8_telemetry
from megafp8.fp8.kurtosis import KurtosisWarning, collect_kurtosis, enable_kurtosis
from megafp8.fp8.rounding_keys import begin_rounding_iteration
from megafp8.fp8.telemetry import collect_block_scale_histograms
from megafp8.model.moe_stats import collect_moe_stats, has_moe, update_expert_biases
from megafp8.training.microscaling_flags import precision_schedule_from_args
from megafp8.parallel import collectives as C
from megafp8.parallel.context_parallel import split_for_context_parallel
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.data_setup import batches, build_datasets
from megafp8.training.arguments import hang_timeout_minutes
from megafp8.training.flops import flops_per_iteration, moe_flops_args
from megafp8.training.grad_noise_trigger import grad_noise_trigger
from megafp8.training.fault_injection import FaultInjection, rank_sample_indices
from megafp8.training.hang_watchdog import HangWatchdog, InjectedStall
from megafp8.training.rerun import RerunStateMachine
from megafp8.training.rerun_flags import checks_enabled
from megafp8.training.profiling import IterationProfiler
from megafp8.training.schedules import decoupled_learning_rate_schedule, learning_rate_schedule
from megafp8.training.stopping import StopSignal, on_any_rank
from megafp8.training.stragglers import gather_work_ms, straggler_line
from megafp8.training.training_log import IterationRecord, TrainingLog, device_peak_tflops

if TYPE_CHECKING:  # annotations only: the flag checks import this module's schedules without the optimizer
    from megafp8.optim.distributed_optimizer import GradStats, StepResult


@dataclass
class TrainProgress:
    """What a resume needs to continue the run where it stopped (saved in checkpoints)."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    consumed_valid_samples: int = 0  # Megatron's name: validation resumes where it stopped (0 in older checkpoints)
    # --check-for-spiky-loss's reference |loss| and the steps in it (megafp8.training.result_checks; 0 in older ones)
    spike_reference: float = 0.0
    spike_samples: int = 0
    # --fp4-until-grad-noise: the first iteration after the trigger's switch (0: not fired; grad_noise_trigger.py)
    fp4_switch_iteration: int = 0


def _mean_over(value: torch.Tensor, group) -> torch.Tensor:
    """Average of a scalar over a group (the DP replicas' losses), left on the device (no host sync).
    Logging-sized: not byte-counted."""
    value = value.detach().float().reshape(1).clone()  # on the loss's device: NCCL reduces no CPU tensor
    if group is not None:
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value.reshape(())


def saturation_guard(parallel_state: ParallelState, threshold: float = 1e-2, patience: int = 3,
                     read_interval: int = 1, switch_lag: int = 1) -> SaturationGuard:
    """The FP8 saturation guard, deciding on the saturation MAX-reduced over the stage's TP x CP x DP ranks; its
    strikes are read on the host every `read_interval` iterations (--log-interval) and at saves, and a trip lands
    `switch_lag` iterations after it (a lagged non-blocking flag, see SaturationGuard)."""
    def all_reduce_max(tensor: torch.Tensor) -> None:
        C.all_reduce(tensor, parallel_state.amax_group, "amax_reduce", op=dist.ReduceOp.MAX)

    def expert_all_reduce_max(tensor: torch.Tensor) -> None:  # expert parallelism: over each expert's holders
        C.all_reduce(tensor, parallel_state.group("expert_amax"), "amax_reduce", op=dist.ReduceOp.MAX)
    return SaturationGuard(threshold, patience, all_reduce_max=all_reduce_max, read_interval=read_interval,
                           switch_lag=switch_lag, expert_all_reduce_max=expert_all_reduce_max)


class Trainer:
    """One rank's training run over this rank's pipeline chunks (`megafp8.parallel.pipeline.Pipeline`, PP=1
    included), their data-parallel grad buffer (`DistributedDataParallel`) and the ZeRO optimizer."""

    def __init__(self, args: argparse.Namespace, parallel_state: ParallelState, pipeline, ddp, optimizer,
                 guard: SaturationGuard | None = None, progress: TrainProgress | None = None,
                 checkpointer=None) -> None:
        self.args, self.ps, self.pipeline, self.ddp, self.optimizer = args, parallel_state, pipeline, ddp, optimizer
        self.loss_scaler = optimizer.loss_scaler  # --fp16 (megafp8.optim.loss_scaler), else None
        self.guard, self.progress, self.checkpointer = guard, progress or TrainProgress(), checkpointer
        self.recipe = Fp8Recipe.from_args(args)
        self.rounds_stochastically = (self.recipe is not None and self.recipe.element_bits == 4
                                      and self.recipe.fp4_stochastic_rounding)
        self.schedule = learning_rate_schedule(args)
        self.decoupled_schedule = decoupled_learning_rate_schedule(args)
        self.train_iters = -(-args.train_samples // args.global_batch_size)
        self.precision_schedule = precision_schedule_from_args(args, self.train_iters)
        self.grad_noise = grad_noise_trigger(args, self.precision_schedule, parallel_state, self.progress)
        # --fp8-saturation-guard-kurtosis: the guard holds the warning, acts on it and checkpoints its windows.
        self.kurtosis_guard = guard is not None and guard.kurtosis_warning is not None
        self.kurtosis_warning = (guard.kurtosis_warning if self.kurtosis_guard
                                 else KurtosisWarning(args.kurtosis_warning_ratio, args.kurtosis_warning_window))
        # The last pipeline stage computes the loss; its first TP/CP/DP rank speaks for the run.
        ps = parallel_state
        self.is_logging_rank = ps.rank == ps.world_size - ps.tp_size * ps.cp_size * ps.dp_size
        self.log = TrainingLog(args.log_dir, args.tensorboard_dir) if self.is_logging_rank else TrainingLog()
        # Each pipeline stage's first TP/CP/DP rank speaks for the saturation guard's switches of its layers.
        self.is_stage_lead = ps.coords.tp == 0 and ps.coords.cp == 0 and ps.coords.dp == 0
        # Under expert parallelism an expert's first holder speaks for the guard's switches of its experts.
        self.is_expert_lead = ps.ep_size > 1 and ps.group("expert_amax").rank == 0
        # The test hooks the environment sets (megafp8.training.fault_injection; none in real runs).
        self.faults = FaultInjection(self.ddp.module, ps.rank, computes_loss=ps.coords.pp == ps.pp_size - 1,
                                     announce=self.is_logging_rank)
        self.train_data, self.valid_data = build_datasets(args)
        self.train_batches = batches(self.train_data, self.progress.consumed_samples, args, parallel_state)
        self.valid_batches = (batches(self.valid_data, self.progress.consumed_valid_samples, args, parallel_state,
                                      cycle=True) if self.valid_data else None)
        self.flops = flops_per_iteration(args.global_batch_size, num_layers=args.num_layers,
                                         hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                                         num_attention_heads=args.num_attention_heads,
                                         num_query_groups=args.num_query_groups, seq_length=args.seq_length,
                                         padded_vocab_size=pipeline.chunks[0].padded_vocab_size,
                                         kv_channels=args.kv_channels, gated_mlp=args.activation != "xielu",
                                         **moe_flops_args(args))
        self.peak = device_peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
        self.profiler = IterationProfiler(args, ps.rank)
        self.has_moe = has_moe(pipeline.chunks)
        self.injected_stall = InjectedStall.from_env()
        self.watchdog: HangWatchdog | None = None
        # The result checks and step re-runs (megafp8.training.rerun); None when every check is off.
        self.rerun = RerunStateMachine(self) if checks_enabled(args) else None
        if self.rerun is not None:
            self.rerun.checks.load_state_dict({"reference": self.progress.spike_reference,
                                               "seen": self.progress.spike_samples})

    # ---- one iteration ----------------------------------------------------------------------
    def _global_batch(self, source) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's share of a global batch: (inputs, labels), each [micro x micro-batches, seq / CP]:
        under context parallelism every CP rank read the same samples and keeps its two chunks of each."""
        tokens = torch.cat([next(source) for _ in range(self.args.num_micro_batches)])
        device = getattr(self.pipeline, "device", None)
        if device is not None and device.type == "cuda":  # through pinned memory: the copy does not block the host
            tokens = tokens.pin_memory().to(device, non_blocking=True)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        if self.ps.cp_size > 1:
            inputs, labels = (split_for_context_parallel(t, 1, self.ps.cp_rank, self.ps.cp_size) for t in (inputs, labels))
        return inputs, labels

    def loss_mask(self, labels: torch.Tensor) -> torch.Tensor | None:
        """The loss mask of this rank's share of the batch (like `labels`); None: every token counts, as the
        data has no mask. Also where the NaN test hooks come in (and tests give uneven masks)."""
        return self.faults.loss_mask(labels.shape, self.progress.iteration + 1, self._attempt())

    def _attempt(self) -> int:
        """0: a step's first run; 1: its re-run (megafp8.training.rerun)."""
        return self.rerun.attempt if self.rerun is not None else 0

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the batch's loss, optimizer updated?, grad norm), as device tensors. The loss is the DP x CP mean of
        each rank's token mean (under CP each rank's is CP x its chunks' share of the sequence mean, so the mean
        is CP=1's); with --calculate-per-token-loss each rank's is DP x CP x its token-loss sum over the global
        batch's loss tokens (the pipeline's normalizer), so the mean is the global batch's token mean, as
        Megatron logs it (the summed losses over the summed tokens).

        The step's phases, in order (the module docstring): ``forward_backward``, ``update_fp8_scales``,
        ``prepare_optimizer_step``, ``apply_optimizer_step``. Up to ``apply_optimizer_step`` no parameter or
        optimizer state has changed, so a StepState captured before the step can restore it for a re-run.

        With any result check on (the default: megafp8.training.rerun) the phases run through
        ``RerunStateMachine.step``, which judges the step between ``prepare_optimizer_step`` and
        ``apply_optimizer_step``; None then says that the previous step turned out suspicious and was re-run in
        this one's place (and counted): this iteration starts over."""
        if self.rerun is not None:
            return self.rerun.step(self)
        loss = self.forward_backward()
        self.update_fp8_scales()
        result = self.apply_optimizer_step(self.prepare_optimizer_step())
        return self.dp_mean_loss(loss), ~result.skipped_flag, result.grad_norm_tensor

    def dp_mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The batch's loss from this rank's (``train_step``'s rule), on the device."""
        return _mean_over(loss, self.ps.dp_group.group)

    def forward_backward(self) -> torch.Tensor:
        """Phase 1: a zeroed grad buffer, the next global batch, forward and backward of its micro-batches; this
        rank's loss (a device tensor). The FP8 amaxes it observed stay pending."""
        self.ddp.zero_grad_buffer()
        if self.precision_schedule is not None and self.precision_schedule.apply(self.pipeline.precision_plans,
                                                                                 self.progress.iteration + 1):
            if self.is_stage_lead:
                print(f" precision schedule: {self.precision_schedule.describe()}", flush=True)
        if self.rounds_stochastically:  # keys of (seed, iteration, rank, layer): a resumed run draws the same bits
            begin_rounding_iteration(self.pipeline.chunks, self.args.seed, self.progress.iteration + 1, self.ps.rank)
        if self.injected_stall is not None:  # the hang watchdog's test hook: this rank stalls here
            self.injected_stall.maybe_sleep(self.ps.rank, self.progress.iteration + 1)
        inputs, labels = self._global_batch(self.train_batches)
        self.faults.arm(self.progress.iteration + 1, self._attempt(), self.sample_indices())
        loss_mask = self.loss_mask(labels)
        probing = self.grad_noise is not None and self.grad_noise.arm(self.ddp.module, self.progress.iteration + 1)
        loss = self.pipeline.forward_backward(inputs, labels, loss_mask)
        if probing:
            self.grad_noise.measure(self.ddp.module, self.progress, self.log if self.is_logging_rank else None)
        if self.args.empty_unused_memory_level >= 1:  # Megatron's places: level 1 after forward/backward,
            torch.cuda.empty_cache()                   # level 2 after the optimizer step as well
        return loss

    def update_fp8_scales(self) -> None:
        """Phase 2: the FP8 delayed-scaling update (one amax collective), also before a step the optimizer skips:
        the next step's scales, under which ``apply_optimizer_step`` publishes the FP8 weights."""
        self.pipeline.update_fp8_scales()

    def prepare_optimizer_step(self) -> GradStats:
        """Phase 3: the DP grad reduction finished, the global grad norm and whether it is finite (on the device)."""
        return self.optimizer.prepare()

    def apply_optimizer_step(self, stats: GradStats) -> StepResult:
        """Phase 4: the update at lr(consumed samples) (--decoupled-lr's schedule for the embedding and output
        layer), skipped on every rank if ``stats`` say non-finite; then the saturation guard's check."""
        consumed = self.progress.consumed_samples
        decoupled_lr = self.decoupled_schedule(consumed) if self.decoupled_schedule is not None else None
        if stats is not self.optimizer.pending_stats:
            raise ValueError("apply_optimizer_step takes the stats of the last prepare_optimizer_step")
        # Through step(), which applies those pending stats: the one entry that wrappers of the update (tools,
        # tests recording the learning rates) see, whether the trainer runs in phases or not.
        result = self.optimizer.step(self.schedule(consumed), decoupled_lr=decoupled_lr)
        if self.has_moe:  # DeepSeek-V3's expert biases follow the step's loads (unless the step was skipped)
            update_expert_biases(self.pipeline.chunks, self.ps.amax_group, ~result.skipped_flag)
        if self.args.empty_unused_memory_level >= 2:
            torch.cuda.empty_cache()
        if self.guard is not None:
            for message in self.guard.check(self.ddp.module, self.progress.iteration + 1):
                expert = ".local_experts." in message
                if (self.is_stage_lead and not (expert and self.ps.ep_size > 1)) or (expert and self.is_expert_lead):
                    print(f" {message}", flush=True)
        return result

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over --eval-iters global batches (no grads, no FP8 scaling-state updates)."""
        losses = []
        for _ in range(self.args.eval_iters):
            losses.append(self.pipeline.evaluate(*self._global_batch(self.valid_batches)))
            if self.args.empty_unused_memory_level >= 1:
                torch.cuda.empty_cache()
        self.progress.consumed_valid_samples += self.args.eval_iters * self.args.global_batch_size
        return float(_mean_over(torch.stack(losses).mean(), self.ps.dp_group.group))

    # ---- the loop ---------------------------------------------------------------------------
    def train(self) -> TrainProgress:
        args, p = self.args, self.progress
        stop = StopSignal()
        self.ps.comm.reset()  # setup traffic (the first parameter gather, a checkpoint load) is no iteration's
        self.ps.comm.take_wait_seconds()
        start_time = self.start_time = time.monotonic()
        window_start, self._window_iters = time.perf_counter(), 0
        # This run's skipped / NaN iterations so far, on the device; folded into `p` when read.
        device = self.optimizer.master_scale.device
        self._new_skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._new_nan = torch.zeros((), dtype=torch.int64, device=device)
        collector_was_on = gc.isenabled()
        if args.manual_gc:  # Megatron's --manual-gc: no collector pauses at random steps on random ranks
            gc.disable()
            gc.collect()
        hang_minutes = hang_timeout_minutes(args)
        if hang_minutes:
            self.watchdog = HangWatchdog(60 * hang_minutes, args.log_dir or ".", self.ps.rank, self.ps.world_size,
                                         self.ps.comm, dataclasses.asdict(self.ps.coords))
        try:
            while p.iteration < self.train_iters:
                self._beat(p.iteration + 1, "iteration")
                telemetry = args.log_fp8_telemetry and (p.iteration + 1) % args.log_interval == 0
                if self.recipe is not None:  # the saturation guard reads telemetry every step
                    enable_fp8_telemetry(self.ddp.module, self.guard is not None or telemetry)
                    if telemetry:  # the inputs' moments on this step only; _collect_telemetry turns them off
                        enable_kurtosis(self.ddp.module, True)
                lr = self.schedule(p.consumed_samples)
                self.profiler.before_iteration(p.iteration)
                outcome = self.train_step()
                if outcome is None:  # the previous step was re-run instead: this one starts over
                    continue
                self.account(*outcome)
                self.profiler.after_iteration(p.iteration)
                if self.rerun is not None and self.rerun.reads_device_after(self, p.iteration):
                    outcome = self.rerun.resolve_now(self) or outcome  # a suspicious step: before it is logged
                loss, updated, grad_norm = outcome
                if p.iteration % args.log_interval == 0:
                    # Read first: on a GPU the host runs ahead, and the read waits for the window's last step.
                    scale = [self.loss_scaler.scale] if self.loss_scaler is not None else []
                    loss, grad_norm, *scale = self._read_counters(loss, grad_norm, *scale)
                    elapsed = (time.perf_counter() - window_start) / self._window_iters
                    work = self._rank_work_ms(elapsed, self._window_iters)
                    moe = (collect_moe_stats(self.pipeline.chunks, self.ps.amax_group, self.ps.pp_group,
                                             self.ps.dp_size) if self.has_moe else {})
                    # The histograms first: a layer the kurtosis rule switches in _collect_telemetry drops its stats.
                    histograms = collect_block_scale_histograms(self.ddp.module) if telemetry else None
                    self._log(loss, lr, grad_norm, elapsed, self._collect_telemetry() if telemetry else None,
                              histograms,
                              loss_scale=scale[0] if scale else None, moe=moe, rank_work_ms=work,
                              rerun_differences=self.rerun.take_differences() if self.rerun is not None else None)
                    self._log_guard_switches()
                    window_start, self._window_iters = time.perf_counter(), 0
                if self.valid_batches is not None and args.eval_iters > 0 and p.iteration % args.eval_interval == 0:
                    self._beat(p.iteration, "evaluation")
                    self._evaluate_and_log()
                stop_now = (self._stop_decision_due() and self._must_stop(stop, start_time)) or (
                    args.exit_interval is not None and p.iteration % args.exit_interval == 0)
                if stop_now and self.rerun is not None:  # (a signal may stop a one-process run at any iteration)
                    self.rerun.resolve_now(self)
                if self.checkpointer is not None and (stop_now or (args.save_interval is not None
                                                                   and p.iteration % args.save_interval == 0)):
                    self.save_checkpoint()
                elif self.checkpointer is not None and args.non_persistent_save_interval \
                        and p.iteration % args.non_persistent_save_interval == 0:
                    self.save_checkpoint(non_persistent=True)
                if args.manual_gc and args.manual_gc_interval and p.iteration % args.manual_gc_interval == 0:
                    gc.collect()
                if stop_now:
                    break
            else:
                if self.checkpointer is not None and (args.save_interval is None or p.iteration % args.save_interval):
                    self.save_checkpoint()  # the final state, unless the last interval just saved it
            self._log_guard_switches()  # those after the last logged iteration
            if self.checkpointer is not None:  # --async-save: the last save commits before the run ends
                self.checkpointer.finish()
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            self.profiler.finish(p.iteration)  # a run that ended or stopped inside the window
            stop.restore()
            self.log.close()
            if args.manual_gc and collector_was_on:  # the process goes on (a test, a notebook): as it was
                gc.enable()
        self._read_counters()
        return p

    def account(self, loss: torch.Tensor, updated: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Count a finished step: the progress, and the skipped / NaN iterations (on the device)."""
        p = self.progress
        p.iteration += 1
        p.consumed_samples += self.args.global_batch_size
        self._window_iters += 1
        device = self._new_skipped.device
        skipped = ~updated.to(device)
        self._new_skipped += skipped
        # NaN iterations: a NaN loss or grad norm; under --fp16 the loss only (an overflow is the scaler's
        # business, as Megatron counts it: skipped, not NaN).
        finite = torch.isfinite(loss.to(device))
        if self.loss_scaler is None:
            finite &= torch.isfinite(grad_norm)
        self._new_nan += skipped & ~finite

    def save_checkpoint(self, non_persistent: bool = False) -> None:
        """Save the current state (every rank): the device counters folded first, so the checkpoint holds them;
        ``non_persistent``: to --non-persistent-ckpt-type's checkpoint instead of --save."""
        self._read_counters()
        if self.rerun is not None and self.rerun.checks.check_spike:
            state = self.rerun.checks.state_dict()
            self.progress.spike_reference, self.progress.spike_samples = state["reference"], state["seen"]
        self._beat(self.progress.iteration, "save")
        if non_persistent:
            self.checkpointer.save_non_persistent(self)
        else:
            self.checkpointer.save(self)
        self._collect_after_save()

    def sample_indices(self, consumed_samples: int | None = None) -> list[list[int]]:
        """The training-split indices of this rank's micro-batches of the step starting at ``consumed_samples``
        (default: the next step's)."""
        consumed = self.progress.consumed_samples if consumed_samples is None else consumed_samples
        return rank_sample_indices(consumed, self.args.micro_batch_size, self.args.num_micro_batches,
                                   self.ps.data_parallel_rank, self.ps.dp_size)

    def _rank_work_ms(self, seconds_per_iteration: float, iterations: int) -> list[float] | None:
        """Every rank's time per iteration of the window outside collective waits (several ranks only; every rank
        calls: one all-gather at a log iteration)."""
        waited = self.ps.comm.take_wait_seconds() / iterations
        if self.ps.world_size == 1:
            return None
        return gather_work_ms(1e3 * max(seconds_per_iteration - waited, 0.0), self.ps.world_size)

    def _beat(self, iteration: int, phase: str) -> None:
        """A phase starts: the hang watchdog (--hang-timeout-minutes) times it."""
        if self.watchdog is not None:
            self.watchdog.beat(iteration, phase)

    def _evaluate_and_log(self) -> None:
        """Evaluate; under --manual-gc collect before it and the young generation after it, as Megatron does
        (its --no-manual-gc-eval, not in megafp8's parser, would turn that off)."""
        around = self.args.manual_gc and getattr(self.args, "manual_gc_eval", True)
        if around:
            gc.collect()
        self._log_validation(self.evaluate())
        if around:
            gc.collect(generation=0)  # what the evaluation made and dropped

    def _collect_after_save(self) -> None:
        """Megatron collects after every save of an FP8 run, collector on or off: the save's dequantized copies."""
        if self.recipe is not None:
            gc.collect()

    def _read_counters(self, *scalars: torch.Tensor) -> list[float]:
        """Fold the device-side skipped/NaN counts into the progress counters and return ``scalars`` as floats:
        one device->host copy of them packed together."""
        packed = torch.stack([self._new_skipped.double(), self._new_nan.double(),
                              *(t.to(self._new_skipped.device).double().reshape(()) for t in scalars)]).tolist()
        self.progress.skipped_iterations += int(packed[0])
        self.progress.nan_iterations += int(packed[1])
        self._new_skipped.zero_()
        self._new_nan.zero_()
        return packed[2:]

    def _stop_decision_due(self) -> bool:
        """Whether the ranks agree on stopping after this iteration. One process decides every iteration (nothing
        to agree on, no collective). Several decide at log, evaluation and save iterations only: the agreement is
        an all-reduce read on the host, and those iterations read the host anyway, so the others run without a
        host sync. A signal or the time limit therefore stops the run at the next such iteration, the same one
        on every rank (keep --log-interval iterations shorter than the scheduler's grace period)."""
        if self.ps.world_size == 1:
            return True
        args, iteration = self.args, self.progress.iteration
        return any(interval and iteration % interval == 0 for interval in (
            args.log_interval, args.save_interval if self.checkpointer is not None else None,
            args.eval_interval if self.valid_batches is not None and args.eval_iters > 0 else None))

    def _must_stop(self, stop: StopSignal, start_time: float) -> bool:
        """A signal or --exit-duration-in-mins on any rank stops every rank after the same iteration (all
        must save it): one MAX all-reduce of the local verdict, at the iterations `_stop_decision_due` names."""
        limit = self.args.exit_duration_in_mins
        out_of_time = limit is not None and time.monotonic() - start_time > 60 * limit
        return on_any_rank(stop.requested or out_of_time)

    def _log(self, loss: float, lr: float, grad_norm: float, seconds_per_iteration: float, telemetry,
             histograms=None, loss_scale: float | None = None, moe: dict | None = None,
             rank_work_ms: list[float] | None = None, rerun_differences: tuple[float, float] | None = None) -> None:
        tflops = self.flops / seconds_per_iteration / self.ps.world_size / 1e12
        record = IterationRecord(
            iteration=self.progress.iteration, train_iters=self.train_iters,
            consumed_samples=self.progress.consumed_samples, lm_loss=loss, grad_norm=grad_norm, lr=lr,
            loss_scale=loss_scale,
            tokens_per_s=self.args.global_batch_size * self.args.seq_length / seconds_per_iteration,
            skipped_iterations=self.progress.skipped_iterations, nan_iterations=self.progress.nan_iterations,
            elapsed_ms_per_iteration=1e3 * seconds_per_iteration, tflops_per_device=tflops,
            comm_bytes=self.ps.comm.snapshot_and_reset(),
            model_state_bytes_per_param=self.optimizer.model_state_bytes_per_param(),
            mfu_bf16=tflops / self.peak[0] if self.peak else None, mfu_fp8=tflops / self.peak[1] if self.peak else None,
            elapsed_s=time.monotonic() - self.start_time,
            eta_s=seconds_per_iteration * (self.train_iters - self.progress.iteration), **(moe or {}),
            rank_work_ms=rank_work_ms,
            rerun_loss_rel_diff=rerun_differences[0] if rerun_differences else None,
            rerun_grad_norm_rel_diff=rerun_differences[1] if rerun_differences else None)
        if self.is_logging_rank:
            print(record.console_line(), flush=True)
            self.log.log_iteration(record, telemetry, histograms)
            line = straggler_line(rank_work_ms or [], self.progress.iteration - self.args.log_interval + 1,
                                  self.progress.iteration)
            if line:
                print(f" {line}", flush=True)

    def _collect_telemetry(self) -> dict[str, float]:
        """The FP8 casts' statistics and the inputs' kurtosis and RMS (moments summed over this rank's TP group, so
        the values do not depend on the TP layout; with --fp8-saturation-guard-kurtosis over the stage's TP x CP x DP
        ranks, so every rank of the stage sees the same alarms and the guard switches the same layers on each); the
        kurtosis warning's lines on each stage's first rank."""
        group = self.ps.amax_group if self.kurtosis_guard else self.ps.tp_group
        kurtosis = collect_kurtosis(self.ddp.module, (lambda t: dist.all_reduce(t, group=group.group))
                                    if group.size > 1 else None)
        enable_kurtosis(self.ddp.module, False)
        alarms = self.kurtosis_warning.check(self.progress.iteration, kurtosis)
        messages = [alarm.message for alarm in alarms]
        telemetry = {**collect_fp8_telemetry(self.ddp.module), **kurtosis}  # before a switch drops a layer's
        if self.kurtosis_guard:
            messages += self.guard.switch_early(self.ddp.module, alarms, self.progress.iteration)
        if self.is_stage_lead:
            for message in messages:
                print(f" {message}", flush=True)
        return telemetry

    def _log_guard_switches(self) -> None:
        """Write the saturation guard's new switches to metrics.jsonl. Each stage decides on its own layers:
        under PP the logging (last) stage gathers the others' over the pipeline group (every rank calls)."""
        if self.guard is None:
            return
        events = self.guard.take_events()
        if self.ps.ep_size > 1:  # experts switch on their holders only: every rank's, each switch once
            gathered = [None] * self.ps.world_size
            dist.all_gather_object(gathered, events)
            unique = {(e["iteration"], e["layer"]): e for rank in gathered for e in rank}
            events = [unique[key] for key in sorted(unique)]
        elif self.ps.pp_size > 1:
            gathered: list = [None] * self.ps.pp_size
            dist.all_gather_object(gathered, events, group=self.ps.pp_group.group)
            events = sorted((e for stage in gathered for e in stage), key=lambda e: (e["iteration"], e["layer"]))
        if self.is_logging_rank:
            for event in events:
                self.log.log_guard_switch(**event)

    def _log_validation(self, val_loss: float) -> None:
        if self.is_logging_rank:
            print(f" validation loss at iteration {self.progress.iteration} | lm loss: {val_loss:.6E} |", flush=True)
            self.log.log_validation(self.progress.iteration, val_loss)
