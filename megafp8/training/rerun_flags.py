"""The result-check and step re-run flags (Megatron-LM's names where it has them) and their checks."""
from __future__ import annotations

import argparse

RERUN_MODES = ("disabled", "validate_results", "report_stats")
PERSISTENT_ACTIONS = ("skip", "exit")
# Megatron-LM's rerun state machine: a job to resume elsewhere / a job that failed result validation.
EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17


def add_rerun_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--rerun-mode", choices=RERUN_MODES, default=None,
                   help="validate_results: a step whose loss or grad norm fails a check below is re-run from the "
                        "same state on the same micro-batches; the same verdict again is persistent (numerics or "
                        "data), a passing re-run transient (a flaky rank: named, exit 17). report_stats: every step "
                        "runs twice, the loss and grad-norm differences logged. disabled: the checks only report "
                        "(default validate_results, disabled with --enable-cuda-graph; docs/training.md, "
                        "'Suspicious steps')")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="a non-finite loss (any rank's) or grad norm is suspicious (--no-...: such steps are only "
                        "skipped, as the optimizer always does)")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="a loss >= --spiky-loss-factor x the largest |loss| of the first --spiky-loss-samples "
                        "checked steps (any rank's local loss; Megatron-LM's rule) is suspicious")
    g.add_argument("--spiky-loss-factor", type=float, default=10.0,
                   help="the spike threshold as a multiple of the reference loss (Megatron-LM's fixed 10)")
    g.add_argument("--spiky-loss-samples", type=int, default=100,
                   help="steps whose largest |loss| makes the spike reference (Megatron-LM's fixed 100)")
    g.add_argument("--rerun-persistent-action", choices=PERSISTENT_ACTIONS, default="skip",
                   help="a suspicious step whose re-run agrees: skip it (as a non-finite step is skipped) and go "
                        "on, or save the state before it and exit 16 (resume elsewhere to tell a faulty node from "
                        "a bad sample)")


def fill_rerun_mode(args: argparse.Namespace) -> None:
    """Megatron-LM's default, validate_results, except under CUDA graphs: a re-run restores a host-side snapshot
    (RNG, FP8 scaling state) that graph replays were not verified against."""
    if args.rerun_mode is None:
        args.rerun_mode = "disabled" if getattr(args, "enable_cuda_graph", False) else "validate_results"


def rerun_errors(args: argparse.Namespace, given: set[str]) -> list[str]:
    errors = []
    if not args.spiky_loss_factor > 1:
        errors.append(f"--spiky-loss-factor must be > 1, got {args.spiky_loss_factor}")
    if args.spiky_loss_samples < 1:
        errors.append(f"--spiky-loss-samples must be >= 1, got {args.spiky_loss_samples}")
    if "--rerun-mode" in given and args.rerun_mode != "disabled" and getattr(args, "enable_cuda_graph", False):
        errors.append(f"--rerun-mode {args.rerun_mode} restores a host-side snapshot (RNG, FP8 scaling state) that "
                      "CUDA graph replays were not verified against: --rerun-mode disabled with --enable-cuda-graph")
    return errors


def checks_enabled(args: argparse.Namespace) -> bool:
    """Whether any result check runs (else the loop carries none of their state or collectives)."""
    return bool(args.check_for_nan_in_loss_and_grad or args.check_for_spiky_loss or args.rerun_mode == "report_stats")
