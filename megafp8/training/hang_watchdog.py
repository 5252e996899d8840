"""A hang that explains itself (--hang-timeout-minutes): when an iteration runs longer than the timeout, every rank
writes its Python stacks and the collectives it entered, and rank 0 says which ranks wait on which.

Each rank runs a daemon thread. The training loop marks the start of every iteration (and of a save or an
evaluation, which get their own timeout). When one phase outlasts the timeout, each rank's thread writes
``hang_iterNNNNNNN/rank{r}.txt`` under the log directory: a JSON line (rank, coordinates, iteration, seconds stuck, the
last collective this rank entered: kind, group, bytes and its number on that group, and how many collectives it
entered on every group) followed by ``faulthandler``'s stacks of all its threads. Every rank of the run is stuck in
the same iteration (the ranks that entered a collective wait in it for the one that did not), so every rank writes.
Rank 0 waits for the files (up to the timeout itself), joins them into ``hang_iterNNNNNNN.txt`` and prints one line:
the ranks that wait in a collective on a group, the members of that group that have not entered it yet (fewer
collectives on the group), and where those chains end: the ranks that hold everyone up. A rank whose file never
comes is named as silent (dead, or on another node without a shared log directory). The run itself goes on: a
transient stall finishes and a real hang still ends at --distributed-timeout-minutes, now with the explanation on
disk.

Collectives are tracked by the byte counters every megafp8 collective already charges (CommCounters.add): a
counter per group and the last one entered. Host cost: one dict update per collective, nothing on the device.
"""
from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
from pathlib import Path

from megafp8.parallel.collectives import CommCounters

# RANK@ITERATION:SECONDS: that rank sleeps that long when the iteration starts (ITERATION *: every iteration)
TEST_HANG_ENV = "MEGAFP8_TEST_HANG"


class HangWatchdog:
    """``beat(iteration, phase)`` at the start of each phase; ``stop()`` at the end of the run."""

    def __init__(self, timeout_s: float, out_dir: str | os.PathLike, rank: int, world_size: int,
                 counters: CommCounters, coordinates: dict[str, int] | None = None) -> None:
        self.timeout_s, self.out_dir = timeout_s, Path(out_dir)
        self.rank, self.world_size, self.counters = rank, world_size, counters
        self.coordinates = coordinates or {}
        self._lock = threading.Lock()
        self._phase: tuple[int, str, float] | None = None  # (iteration, phase, start)
        self._reported: tuple[int, str] | None = None
        self._stop = threading.Event()
        self.reports: list[Path] = []  # the joined files rank 0 wrote
        self._thread = threading.Thread(target=self._watch, name="megafp8-hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, iteration: int, phase: str = "iteration") -> None:
        with self._lock:
            self._phase = (iteration, phase, time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            with self._lock:
                phase = self._phase
            if phase is None or (phase[0], phase[1]) == self._reported:
                continue
            stuck = time.monotonic() - phase[2]
            if stuck > self.timeout_s:
                self._reported = (phase[0], phase[1])
                self._report(phase[0], phase[1], stuck)

    def _report(self, iteration: int, phase: str, stuck: float) -> None:
        directory = self.out_dir / f"hang_iter{iteration:07d}"
        directory.mkdir(parents=True, exist_ok=True)
        facts = dict(rank=self.rank, coordinates=self.coordinates, iteration=iteration, phase=phase,
                     seconds=round(stuck, 1), last_collective=self.counters.last_entered,
                     entered={",".join(map(str, ranks)): n for ranks, n in self.counters.entered.items()})
        partial = directory / f".rank{self.rank}.txt"
        with open(partial, "w") as f:
            f.write(json.dumps(facts) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        partial.rename(directory / f"rank{self.rank}.txt")  # whole or absent: rank 0 never reads half a file
        if self.rank == 0:
            self._join(directory, iteration, phase, stuck)

    def _join(self, directory: Path, iteration: int, phase: str, stuck: float) -> None:
        deadline = time.monotonic() + self.timeout_s
        files = {}
        while time.monotonic() < deadline and len(files) < self.world_size and not self._stop.is_set():
            files = {int(p.stem[4:]): p for p in directory.glob("rank*.txt")}
            time.sleep(0.2)
        facts = {rank: json.loads(path.read_text().split("\n", 1)[0]) for rank, path in files.items()}
        joined = self.out_dir / f"hang_iter{iteration:07d}.txt"
        with open(joined, "w") as f:
            for rank in sorted(files):
                f.write(f"===== rank {rank} =====\n{files[rank].read_text()}\n")
        self.reports.append(joined)
        silent = sorted(set(range(self.world_size)) - set(facts))
        print(f" hang: {phase} {iteration} has run {stuck:.0f} s (--hang-timeout-minutes {self.timeout_s / 60:g}); "
              f"{who_waits_on_whom(facts)}"
              + (f"; no report from ranks {_ranks(silent)}" if silent else "") + f"; every stack: {joined}",
              flush=True)


def who_waits_on_whom(facts: dict[int, dict]) -> str:
    """From the ranks' reports: for each group some ranks wait in, the members that have not entered that collective."""
    waits: dict[tuple, list[int]] = {}
    for rank, fact in sorted(facts.items()):
        last = fact["last_collective"]
        if last is None or not last["ranks"]:
            continue
        group = ",".join(map(str, last["ranks"]))
        behind = [m for m in last["ranks"] if m in facts and facts[m]["entered"].get(group, 0) < last["number"]]
        if behind:
            waits.setdefault((last["kind"], group, tuple(behind)), []).append(rank)
    if not waits:
        return "no rank waits for another in a collective (a slow step, or a wait outside megafp8's collectives)"
    # A rank waited on may itself wait on another: the chains end at the ranks that wait on nobody.
    waiting = {rank for ranks in waits.values() for rank in ranks}
    roots = sorted({rank for (_, _, behind) in waits for rank in behind} - waiting)
    chains = "; ".join(f"ranks {_ranks(ranks)} wait in {kind} over ranks {group} for ranks {_ranks(list(behind))}, "
                       "which have not entered it" for (kind, group, behind), ranks in waits.items())
    head = (f"ranks {_ranks(roots)} hold up the others (every wait leads to them, and they wait in no collective)"
            if roots else "the waits form a cycle (ranks entered collectives in different orders)")
    return f"{head}: {chains}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


class InjectedStall:
    """The test hook ``MEGAFP8_TEST_HANG=RANK@ITERATION:SECONDS``: that rank sleeps at that iteration's start (a
    stall, for the watchdog), or at every iteration's with ``*`` (a straggler, for megafp8.training.stragglers)."""

    ENV = TEST_HANG_ENV

    def __init__(self, rank: int, iteration: int | None, seconds: float) -> None:
        self.rank, self.iteration, self.seconds = rank, iteration, seconds

    @classmethod
    def from_env(cls) -> "InjectedStall | None":
        value = os.environ.get(TEST_HANG_ENV)
        if not value:
            return None
        try:
            rank, rest = value.split("@")
            iteration, seconds = rest.split(":")
            return cls(int(rank), None if iteration == "*" else int(iteration), float(seconds))
        except ValueError:
            raise ValueError(f"{TEST_HANG_ENV}={value!r}: expected RANK@ITERATION:SECONDS, e.g. 1@3:20") from None

    def maybe_sleep(self, rank: int, iteration: int) -> None:
        if rank == self.rank and self.iteration in (None, iteration):
            time.sleep(self.seconds)
