"""Suspicious steps (--rerun-mode, --check-for-nan-in-loss-and-grad, --check-for-spiky-loss): a step whose loss or
grad norm fails a check is re-run from the same state on the same micro-batches, to tell a flaky rank (transient)
from numerics or data (persistent); every event leaves a flight record.

Free when nothing is wrong: each step is judged on the device (megafp8.training.result_checks: one 2-float
all-reduce), a suspicious step is kept from updating anything by the same device-side flag the optimizer skips
non-finite steps with, and its verdict reaches the host without a sync: read during the next step, after that
step's forward/backward was queued and before its update (as the saturation guard's flag), or at once at an
iteration that reads the device anyway (log, evaluation, save, exit). Each step's start state is captured on the
host without blocking (megafp8.training.step_state.StepState).

On a suspicious step k, under validate_results (the default, Megatron-LM's): the state before k is restored (a
later step's attempt is dropped), k runs again with hooks that find the first non-finite module, and
    the same verdict again -> persistent: k is skipped, as a non-finite step always was (or, with
        --rerun-persistent-action exit, the state before k is saved and the run exits 16, Megatron-LM's
        "resume to disambiguate": on other nodes, a persistent result again is the data's or the numerics');
    a passing re-run -> transient: the ranks whose own loss changed between the attempts are named, the state
        before k is saved, and the run exits 17 (Megatron-LM's "failed on result validation") so the scheduler
        replaces the node.
A spike that the re-run reproduces is skipped too (Megatron-LM applies it; the step a spike comes from is the one
to leave out). report_stats runs every step twice and logs the largest relative differences of the loss and grad
norm per log window (a determinism measurement); disabled re-runs nothing: the checks only report.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from megafp8.fp8 import collect_fp8_telemetry, enable_fp8_telemetry
from megafp8.training.flight_record import NonFiniteFinder, first_nonfinite, gather_to_all, write_flight_record
from megafp8.training.result_checks import HostFlag, ResultChecks, Verdict
from megafp8.training.rerun_flags import EXIT_CODE_FAILED_ON_RESULT_VALIDATION, EXIT_CODE_RESUME_TO_DISAMBIGUATE
from megafp8.training.step_state import StepState


class RerunExit(Exception):
    """Stop the run with Megatron-LM's exit code (after the state before the suspicious step was saved)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class _Pending:
    """A step whose verdict the host has not read yet."""

    iteration: int
    verdict: Verdict
    flag: HostFlag
    state: StepState | None  # the state before the step (None under --rerun-mode disabled)
    consumed_samples: int


class RerunStateMachine:
    """One rank's side of the result checks and re-runs (module docstring); every rank takes the same decisions."""

    def __init__(self, trainer) -> None:
        args = trainer.args
        self.mode = args.rerun_mode
        self.persistent_action = args.rerun_persistent_action
        self.checks = ResultChecks(args.check_for_nan_in_loss_and_grad, args.check_for_spiky_loss,
                                   args.spiky_loss_factor, args.spiky_loss_samples,
                                   fp16=trainer.loss_scaler is not None, device=trainer.optimizer.master_scale.device)
        self.log_dir = args.log_dir or "."
        self.pending: list[_Pending] = []
        self.attempt = 0  # 0: a step's first run, 1: its re-run (the fault-injection hooks ask)
        # The first step of a process is judged but not re-run (Megatron-LM's rule too): the FP8 scaling states
        # bind to their manager's flat buffers in its update, which a snapshot before it would do too early.
        self.first_step_done = False
        # report_stats: the window's largest relative differences between a step's two runs (device tensors)
        self.loss_diff = torch.zeros((), dtype=torch.float64, device=self.checks.reference.device)
        self.norm_diff = torch.zeros_like(self.loss_diff)

    # ---- the training loop's side ------------------------------------------------------------
    def step(self, trainer):
        """``Trainer.train_step`` under the checks: (loss, updated, grad norm), or None when the previous step turned
        out suspicious and was re-run in this one's place (and counted): the loop then starts this iteration over."""
        if self.mode == "report_stats":
            return self.run_twice(trainer)
        state = self.capture(trainer)
        loss = trainer.forward_backward()
        trainer.update_fp8_scales()
        stats = self.screen(trainer, loss, trainer.prepare_optimizer_step(), state)
        earlier = self.lagged_suspect()  # the previous step's verdict, read while this step's work is queued
        if earlier is not None:
            outcome = self.handle(trainer, earlier)
            if outcome is not None:  # this attempt was dropped by the restore
                trainer.account(*outcome)
                return None
        result = trainer.apply_optimizer_step(stats)
        return trainer.dp_mean_loss(loss), ~result.skipped_flag, result.grad_norm_tensor

    def reads_device_after(self, trainer, iteration: int) -> bool:
        """Whether the loop reads the device after this iteration anyway (log, evaluation, save, exit, the end):
        there the step's verdict is read at once."""
        args = trainer.args

        def due(interval: int | None) -> bool:
            return bool(interval) and iteration % interval == 0
        return (iteration == trainer.train_iters or due(args.log_interval) or due(args.exit_interval)
                or (trainer.checkpointer is not None and (due(args.save_interval)
                                                          or due(args.non_persistent_save_interval)))
                or (trainer.valid_batches is not None and args.eval_iters > 0 and due(args.eval_interval)))

    def resolve_now(self, trainer):
        """If the step just run is suspicious, deal with it now: its re-run's (loss, updated, grad norm), counted,
        or None (nothing re-run)."""
        entry = self.current_suspect()
        outcome = self.handle(trainer, entry) if entry is not None else None
        if outcome is not None:
            trainer.account(*outcome)
        return outcome

    # ---- every step -------------------------------------------------------------------------
    def capture(self, trainer) -> StepState | None:
        """The state before the step, when it may be re-run."""
        capture = self.mode != "disabled" and self.first_step_done
        self.first_step_done = True
        return StepState.capture(trainer) if capture else None

    def screen(self, trainer, local_loss: torch.Tensor, stats, state: StepState | None):
        """Judge the step that ``stats`` (its pending GradStats) close; under validate_results a suspicious step is
        rejected on the device (skipped by the optimizer like a non-finite one). Returns the stats to apply."""
        verdict = self.checks.judge(local_loss, stats.grad_norm)
        if self.mode == "validate_results" and state is not None:
            stats = dataclasses.replace(stats, rejected=verdict.suspicious)
            trainer.optimizer.pending_stats = stats
        self.pending.append(_Pending(trainer.progress.iteration + 1, verdict, HostFlag(verdict.suspicious), state,
                                     trainer.progress.consumed_samples))
        return stats

    def lagged_suspect(self) -> _Pending | None:
        """The previous step, if the checks found it suspicious (read while the current step's work is queued)."""
        return self._take(self.pending[:-1])

    def current_suspect(self) -> _Pending | None:
        """The step just run, if suspicious (at an iteration that reads the device anyway)."""
        return self._take(self.pending)

    def _take(self, candidates: list[_Pending]) -> _Pending | None:
        for entry in candidates:
            self.pending.remove(entry)
            if entry.flag.read():
                return entry
        return None

    # ---- a suspicious step ------------------------------------------------------------------
    def handle(self, trainer, entry: _Pending):
        """Deal with suspicious step ``entry`` (module docstring). Returns the step's final (loss, updated, grad
        norm) after a re-run that goes on, None when nothing was re-run (disabled, or the saturation guard switched
        a layer during the step: the step stays as it ran). Raises RerunExit to stop."""
        first = entry.verdict
        kind = first.kind()
        if self.mode != "validate_results" or entry.state is None:
            why = f"--rerun-mode {self.mode}" if self.mode != "validate_results" else "the process's first step"
            self._report(trainer, entry, None, [], f"not re-run ({why})", "skipped" if kind == "nan" else "applied")
            return None
        try:
            entry.state.restore(trainer)
        except RuntimeError as e:  # the guard switched a layer in that step: it cannot be replayed
            self._report(trainer, entry, None, [], f"not re-run: {e}", "skipped")
            return None
        self.pending.clear()  # a later step's attempt, if any, is dropped with the restore
        trainer.optimizer.publish()  # the restored FP8 scales' weights, as before the step (see StepState)
        rerun, local, stats, finder = self._run_again(trainer, entry)
        reproduced = bool(rerun.nonfinite) if kind == "nan" else bool(rerun.suspicious)
        per_rank = gather_to_all({"rank": trainer.ps.rank, "coords": dataclasses.asdict(trainer.ps.coords),
                                  "computes_loss": _computes_loss(trainer),
                                  "local_loss": [float(first.local_loss), float(rerun.local_loss)],
                                  "finding": finder.finding, "fp8": self._telemetry(trainer)})
        if reproduced:
            diagnosis = "persistent (reproduced on re-run: numerics or data)"
            if self.persistent_action == "skip":
                trainer.optimizer.pending_stats = stats = dataclasses.replace(stats, rejected=rerun.suspicious)
                self._report(trainer, entry, rerun, per_rank, diagnosis, "skipped")
                result = trainer.apply_optimizer_step(stats)
                return trainer.dp_mean_loss(local), ~result.skipped_flag, result.grad_norm_tensor
            path = self._report(trainer, entry, rerun, per_rank, diagnosis,
                                f"saved the state before it, exit {EXIT_CODE_RESUME_TO_DISAMBIGUATE}")
            self._stop(trainer, entry, EXIT_CODE_RESUME_TO_DISAMBIGUATE,
                       f"iteration {entry.iteration}: a {kind} step reproduced on re-run; resume from the saved "
                       f"state on other nodes to tell a faulty node from the data (flight record {path})")
        flaky = _disagreeing_ranks(per_rank)
        diagnosis = ("transient (the re-run passed): " + (f"rank(s) {', '.join(map(str, flaky))} computed a different "
                     "loss" if flaky else "no rank's own loss changed (the grad norm did)"))
        path = self._report(trainer, entry, rerun, per_rank, diagnosis,
                            f"saved the state before it, exit {EXIT_CODE_FAILED_ON_RESULT_VALIDATION}", flaky)
        self._stop(trainer, entry, EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                   f"iteration {entry.iteration}: transient {kind}"
                   + (f" on rank(s) {', '.join(map(str, flaky))}" if flaky else "")
                   + f": replace the node and resume (flight record {path})")

    def _run_again(self, trainer, entry: _Pending):
        """Step ``entry.iteration`` again from the restored state, with the non-finite finder's hooks."""
        micro_batches = trainer.sample_indices(entry.consumed_samples)
        if trainer.recipe is not None:
            enable_fp8_telemetry(trainer.ddp.module, True)
        finder = NonFiniteFinder(trainer.ddp.module, micro_batches)
        try:
            local, stats = self._prepared_step(trainer, attempt=1)
        finally:
            finder.remove()
        return self.checks.judge(local, stats.grad_norm), local, stats, finder

    def _prepared_step(self, trainer, attempt: int):
        """The step's phases up to its update: (this rank's loss, the pending GradStats), as attempt ``attempt``."""
        self.attempt = attempt
        try:
            loss = trainer.forward_backward()
            trainer.update_fp8_scales()
            return loss, trainer.prepare_optimizer_step()
        finally:
            self.attempt = 0

    def _stop(self, trainer, entry: _Pending, code: int, message: str):
        """Back to the state before the step, saved (unless that iteration is saved already), then RerunExit."""
        entry.state.restore(trainer)
        trainer.optimizer.publish()
        checkpointer = trainer.checkpointer
        if checkpointer is not None and checkpointer.last_saved_iteration != trainer.progress.iteration:
            trainer.save_checkpoint()
            checkpointer.finish()
        raise RerunExit(code, message)

    def _telemetry(self, trainer) -> dict:
        return collect_fp8_telemetry(trainer.ddp.module) if trainer.recipe is not None else {}

    def _report(self, trainer, entry: _Pending, rerun: Verdict | None, per_rank: list[dict], diagnosis: str,
                action: str, flaky: list[int] = ()) -> str | None:
        """The console lines and the flight record (written by rank 0; every rank calls)."""
        first = entry.verdict
        if not per_rank:
            per_rank = gather_to_all({"rank": trainer.ps.rank, "coords": dataclasses.asdict(trainer.ps.coords),
                                      "computes_loss": _computes_loss(trainer),
                                      "local_loss": [float(first.local_loss)], "finding": None,
                                      "fp8": self._telemetry(trainer)})
        if trainer.ps.rank != 0:
            return None
        args = trainer.args
        gbs = args.global_batch_size
        telemetry = {}
        for rank in per_rank:
            for key, value in rank.pop("fp8").items():
                telemetry.setdefault(key, value)
        attempts = [_attempt(first)] + ([_attempt(rerun)] if rerun is not None else [])
        record = {
            "iteration": entry.iteration,
            "kind": first.kind(),
            "diagnosis": diagnosis,
            "action": action,
            "rerun_mode": self.mode,
            "attempts": attempts,
            "spike_rule": self.checks.describe_rule() if self.checks.check_spike else None,
            "first_nonfinite": first_nonfinite(per_rank),
            "flaky_ranks": list(flaky),
            "samples": {"consumed_samples_before": entry.consumed_samples,
                        "global_batch": [entry.consumed_samples, entry.consumed_samples + gbs],
                        "note": "indices into the training split; tools/show_samples.py prints their text"},
            "seed": args.seed,
            "ranks": per_rank,
            "fp8_telemetry": telemetry,
            "run_args": _plain_args(args),  # what rebuilds the data (tools/show_samples.py)
        }
        path = write_flight_record(self.log_dir, record)
        where = record["first_nonfinite"]
        found = (f"; first non-finite: {where['module']} ({where['pass']}, rank {where['rank']}"
                 + (f", samples {where['samples']}" if where.get("samples") else "") + ")") if where else ""
        print(f" suspicious step at iteration {entry.iteration}: {first.kind()} (loss {_loss(first):.6g}, "
              f"grad norm {float(first.grad_norm):.6g}) -> {diagnosis}; {action}{found}; flight record {path}", flush=True)
        return str(path)

    # ---- report_stats -----------------------------------------------------------------------
    def run_twice(self, trainer):
        """--rerun-mode report_stats: the step, then again from the same state; the second run is applied."""
        state = StepState.capture(trainer)
        local, stats = self._prepared_step(trainer, attempt=0)
        first_loss, first_norm = local.detach().double().clone(), stats.grad_norm.clone()
        state.restore(trainer)
        local, stats = self._prepared_step(trainer, attempt=1)
        stats = self.screen(trainer, local, stats, None)  # reported like disabled's: not re-run again
        self.loss_diff = torch.maximum(self.loss_diff, _relative(first_loss, local.detach().double()))
        self.norm_diff = torch.maximum(self.norm_diff, _relative(first_norm, stats.grad_norm.double()))
        result = trainer.apply_optimizer_step(stats)
        return trainer.dp_mean_loss(local), ~result.skipped_flag, result.grad_norm_tensor

    def take_differences(self) -> tuple[float, float] | None:
        """report_stats: the window's largest relative (loss, grad norm) differences over every rank (every rank
        calls, at a log iteration); None in the other modes."""
        if self.mode != "report_stats":
            return None
        both = torch.stack([self.loss_diff, self.norm_diff])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
        self.loss_diff.zero_()
        self.norm_diff.zero_()
        loss, norm = both.tolist()
        return loss, norm


def _relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| / |a| (0 when equal, NaN-safe: two NaNs count as equal, one NaN as 1)."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = (a - b).abs() / a.abs().clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(both_nan | (a == b), 0.0, torch.nan_to_num(diff, nan=1.0, posinf=1.0))


def _plain_args(args) -> dict:
    """The run's flags that JSON holds as they are (all the data and tokenizer ones are)."""
    plain = (str, int, float, bool, type(None))
    return {name: value for name, value in vars(args).items()
            if isinstance(value, plain) or (isinstance(value, list) and all(isinstance(v, plain) for v in value))}


def _computes_loss(trainer) -> bool:
    """A rank of the last pipeline stage: its loss is its own (the first stage's is a copy of the last's)."""
    return trainer.ps.coords.pp == trainer.ps.pp_size - 1


def _disagreeing_ranks(per_rank: list[dict]) -> list[int]:
    """Ranks whose own loss differs between the two attempts (NaN and NaN agree)."""
    def same(a: float, b: float) -> bool:
        return (math.isnan(a) and math.isnan(b)) or a == b
    return [r["rank"] for r in per_rank
            if r["computes_loss"] and len(r["local_loss"]) == 2 and not same(*r["local_loss"])]


def _attempt(verdict: Verdict) -> dict:
    return {"loss": _loss(verdict), "grad_norm": float(verdict.grad_norm), "nonfinite": bool(verdict.nonfinite),
            "spike": bool(verdict.spike)}


def _loss(verdict: Verdict) -> float:
    """The largest |loss| of any rank (NaN when some rank's loss was non-finite)."""
    return float("nan") if bool(verdict.loss_nonfinite) else float(verdict.loss_max)
