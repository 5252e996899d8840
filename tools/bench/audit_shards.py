"""How kernel_audit.py's cases are spread over the parallel shards of gpu_check.sh's precompile step: each case goes
to one shard, by its family's estimated compile seconds, so the slowest shard (the step's wall time) is as short as
the cases allow.

    python tools/bench/audit_shards.py [--quick] [--shards 8]     # the plan: cases and estimated seconds per shard

Round-robin by case index put whole runs of one family on a shard (e.g. a Gluon GEMM every 8th case); here the
longest cases are placed first, each on the least loaded shard (longest-processing-time first), which keeps every
shard within the longest case of the average.
"""
from __future__ import annotations

import argparse
import sys

# CPU seconds to compile one case of each family for sm_90a and read it back (Triton's compile, then the audit's own
# ptxas -v and nvdisasm), under Triton 3.6.0 (the GPU image's) on the 2-core CPU test machine, 2026-12-05: each
# family's mean wall seconds per case (kernel_audit's "seconds"; "training ..." from its training rows) times 0.63, the
# CPU / wall ratio of that run (185 CPU s in 296 s of case time: three other jobs shared the cores), i.e. what one
# dedicated core takes, as each of the GPU host's 8 parallel shards has. docs/benchmarks.md, "gpu_check budgets".
FAMILY_SECONDS = {"gemm triton": 0.7, "gemm gluon": 1.1, "quantize": 0.9, "norm_quantize": 1.8, "optimizer": 1.1,
                  "training gemm": 0.9, "training cast": 1.5, "attention": 4.0,
                  "grouped gemm": 0.9}  # not measured on its own: a plain GEMM's, the same main loop
# Each shard process's own start (CPU seconds): python, torch, triton and megafp8_kernels imports.
SHARD_START_SECONDS = 4.0


def shard_plan(families: list[str], shards: int) -> list[int]:
    """The shard of every case (in audit order), given each case's family."""
    load = [0.0] * shards
    plan = [0] * len(families)
    by_cost = sorted(range(len(families)), key=lambda i: -FAMILY_SECONDS[families[i]])  # stable: ties keep order
    for index in by_cost:
        target = min(range(shards), key=lambda s: load[s])
        plan[index] = target
        load[target] += FAMILY_SECONDS[families[index]]
    return plan


def estimate(families: list[str], shards: int) -> list[float]:
    """Estimated wall seconds of each shard: its start plus its cases' family seconds."""
    seconds = [SHARD_START_SECONDS] * shards
    for index, shard in enumerate(shard_plan(families, shards)):
        seconds[shard] += FAMILY_SECONDS[families[index]]
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="kernel_audit.py --quick's cases")
    parser.add_argument("--shards", type=int, default=8)
    args = parser.parse_args(argv)
    from kernel_audit import case_families  # beside this script

    families = case_families(args.quick)
    plan = shard_plan(families, args.shards)
    print("| shard | cases | estimated seconds |\n|---|---|---|")
    for shard, seconds in enumerate(estimate(families, args.shards)):
        print(f"| {shard}/{args.shards} | {plan.count(shard)} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
