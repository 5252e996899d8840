"""--fp4-until-grad-noise: the precision schedule's switch fired by "FP4 All the Way"'s rule instead of an iteration.

Every --fp4-grad-noise-interval iterations the FP4 layers measure their weight gradients exactly and the FP4 wgrad
GEMM's error on them (megafp8.fp8.grad_noise). The trainer sums both over the data-parallel (x CP) replicas, as the
gradient itself is reduced, and over every layer of every stage:

    ratio = ||exact wgrad|| / ||FP4 wgrad - exact wgrad||          (all FP4 layers' weights as one vector)

Chmiel et al. ("FP4 All the Way", 2025): FP4 training stops paying once the gradient norm falls below about sqrt(3)
times the quantization noise, so the switch fires at the first probe with ratio < --fp4-grad-noise-threshold (sqrt(3))
and lands on the next iteration. Every rank computes the same ratio from the same sums, so all switch together, with
no broadcast. The iteration it landed on is kept in the checkpoint (TrainProgress.fp4_switch_iteration): a run resumed
after it switches before its first step, a run resumed before it probes the same steps and fires at the same one, so
either resume is bit-exact. The probe itself leaves the step's numerics alone (its GEMMs write only its buffers).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megafp8.fp8.grad_noise import enable_grad_noise_probes, grad_noise_probes
from megafp8.fp8.precision_schedule import PrecisionSchedule
from megafp8.parallel import collectives as C
from megafp8.parallel.parallel_state import ParallelState

SQRT3 = math.sqrt(3.0)


class GradNoiseTrigger:
    """Probes on its interval until the schedule switched; `measure` after each probed step's backward."""

    def __init__(self, schedule: PrecisionSchedule, interval: int, threshold: float,
                 parallel_state: ParallelState) -> None:
        self.schedule, self.interval, self.threshold, self.ps = schedule, interval, threshold, parallel_state

    def probes(self, iteration: int) -> bool:
        return not self.schedule.done and iteration % self.interval == 0

    def arm(self, model: nn.Module, iteration: int) -> bool:
        """Before `iteration`'s forward: probes on the FP4 layers if it is a probe step (else none)."""
        probing = self.probes(iteration)
        enable_grad_noise_probes(model, probing)
        return probing

    def measure(self, model: nn.Module, progress, log=None) -> float:
        """After the backward of the probed step `progress.iteration + 1` (every rank): the ratio. If it fires, the
        switch lands on the next iteration, which the progress keeps for checkpoints. `log`: the logging rank's
        TrainingLog (the ratio into metrics.jsonl, the line when it fires). Takes the probes away."""
        iteration = progress.iteration + 1
        probes = grad_noise_probes(model)
        sums = torch.zeros(2, dtype=torch.float64, device=_device(model))
        replicas = self.ps.dp_group
        for probe in probes:  # summed over the DP x CP replicas like the gradient (the same layers on each)
            for part, buffer in enumerate((probe.exact, probe.noise)):
                C.all_reduce(buffer, replicas, "dp_grad_reduce")
                sums[part] += buffer.double().square().sum()
        enable_grad_noise_probes(model, False)
        if self.ps.world_size > 1:  # every stage's and TP shard's layers; each replica's sums counted once
            dist.all_reduce(sums)
            sums /= replicas.size
        exact, noise = sums.sqrt().tolist()
        ratio = exact / noise if noise > 0 else math.inf
        fires = ratio < self.threshold and iteration + 1 < self.schedule.at
        if fires:
            self.schedule.at = progress.fp4_switch_iteration = iteration + 1
        if log is not None:
            log.log_grad_noise(iteration, ratio)
            if fires:
                print(f" {self.describe(ratio, iteration)}", flush=True)
        return ratio

    def describe(self, ratio: float, iteration: int) -> str:
        return (f"precision schedule: at iteration {iteration} the FP4 weight gradients' norm is {ratio:.3f} x their "
                f"quantization noise (< {self.threshold:.3f}, --fp4-grad-noise-threshold)")


def grad_noise_trigger(args, schedule: PrecisionSchedule | None, parallel_state: ParallelState,
                       progress) -> GradNoiseTrigger | None:
    """The run's trigger (None without --fp4-until-grad-noise), with a resumed run's switch already fired."""
    if schedule is None or not getattr(args, "fp4_until_grad_noise", False):
        return None
    if progress.fp4_switch_iteration:
        schedule.at = min(schedule.at, progress.fp4_switch_iteration)
    return GradNoiseTrigger(schedule, args.fp4_grad_noise_interval or args.log_interval,
                            args.fp4_grad_noise_threshold, parallel_state)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
