"""Per-rank work time and the straggler line: which rank makes the others wait.

Every rank's time per iteration in a logging window minus the time it spent blocked in collectives' waits (counted by
megafp8.parallel.collectives.PendingCollective) is its own work: compute, data loading, host overhead. In lockstep
training the iteration times are equal on every rank, but the work is not: a slow GPU, a throttled node or a slow
data loader shows as one rank working while the others wait for it. At each log iteration the ranks' work times are
gathered (one small all-gather, at an iteration that reads the host anyway), written to metrics.jsonl as
``rank_work_ms`` and, when the slowest rank works more than ``ratio`` x the median (default 1.2, Megatron's
straggler detector reports the same kind of min/max spread), the logging rank prints one line naming it.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

STRAGGLER_RATIO = 1.2


def gather_work_ms(work_ms: float, world_size: int) -> list[float]:
    """Every rank's work per iteration (ms), in rank order (every rank calls; one all-gather)."""
    if world_size == 1 or not dist.is_initialized():
        return [work_ms]
    device = torch.cuda.current_device() if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([work_ms], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return [float(t) for t in torch.cat(everyone).tolist()]


def straggler_line(work_ms: list[float], first: int, last: int, ratio: float = STRAGGLER_RATIO) -> str | None:
    """The line naming the slowest rank when it works more than ``ratio`` x the median rank, else None."""
    if len(work_ms) < 2:
        return None
    median = statistics.median(work_ms)
    slowest = max(range(len(work_ms)), key=work_ms.__getitem__)
    if median <= 0 or work_ms[slowest] <= ratio * median:
        return None
    fastest = min(range(len(work_ms)), key=work_ms.__getitem__)
    return (f"straggler: rank {slowest} works {work_ms[slowest] / median:.2f}x the median rank per iteration "
            f"({work_ms[slowest]:.1f} ms vs {median:.1f} ms outside collective waits; fastest rank {fastest}: "
            f"{work_ms[fastest]:.1f} ms) over iterations {first}-{last}")
