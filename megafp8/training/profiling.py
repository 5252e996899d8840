"""`--profile`: a torch.profiler Chrome trace of chosen iterations on chosen ranks, so a run shows where its time goes.

Megatron's flags and numbering: the trace starts once `--profile-step-start` iterations are done and stops once
`--profile-step-end` are, i.e. it covers iterations start+1 .. end as the log line numbers them, on each rank of
`--profile-ranks`. The trace is written to `<--log-dir or --tensorboard-dir>/profile/rank<R>.iter<A>-<B>.json`
(open it in Perfetto, ui.perfetto.dev, or chrome://tracing).
"""
from __future__ import annotations

import argparse
import os

import torch


def profile_errors(args: argparse.Namespace, world_size: int) -> list[str]:
    """The --profile flags' problems, one line each, before any process group."""
    if not args.profile:
        return []
    errors = []
    if args.log_dir is None and args.tensorboard_dir is None:
        errors.append("--profile needs --log-dir (or --tensorboard-dir): the trace is written to DIR/profile/")
    if not 0 <= args.profile_step_start < args.profile_step_end:
        errors.append(f"--profile-step-start {args.profile_step_start} and --profile-step-end {args.profile_step_end}: "
                      "need 0 <= start < end (the trace covers iterations start+1 .. end)")
    bad_ranks = [r for r in args.profile_ranks if not 0 <= r < world_size]
    if bad_ranks:
        errors.append(f"--profile-ranks {' '.join(map(str, bad_ranks))}: not a rank of this run (0 .. {world_size - 1})")
    return errors


class IterationProfiler:
    """Starts torch.profiler before iteration start+1 and writes the trace after iteration end; inert on ranks not
    profiled and without --profile (two integer comparisons per iteration)."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.enabled = bool(args.profile) and rank in args.profile_ranks
        self.start, self.end, self.rank = args.profile_step_start, args.profile_step_end, rank
        self.directory = os.path.join(args.log_dir or args.tensorboard_dir or ".", "profile")
        self._profiler: torch.profiler.profile | None = None
        self._first = 0

    def before_iteration(self, done: int) -> None:
        """Called with the number of iterations done so far (a resumed run inside the window starts at once)."""
        if self.enabled and self._profiler is None and self.start <= done < self.end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
            self._first = done + 1

    def after_iteration(self, done: int) -> None:
        if self._profiler is not None and done >= self.end:
            self.finish(done)

    def finish(self, done: int) -> str | None:
        """Stop and write the trace (also when the run ends or stops inside the window); returns its path."""
        if self._profiler is None:
            return None
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the window's kernels belong in its trace
        self._profiler.stop()
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"rank{self.rank}.iter{self._first}-{done}.json")
        self._profiler.export_chrome_trace(path)
        self._profiler = None
        print(f"megafp8: rank {self.rank}: profile of iterations {self._first}-{done} written to {path} "
              "(open it in ui.perfetto.dev or chrome://tracing)", flush=True)
        return path
