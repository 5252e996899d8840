"""Pipeline bubble per rank from each schedule's executed action order: 1F1B, interleaved, interleaved-zb, ZBV,
DualPipeV, in fp32 and FP8 (with the FP8 weight gradient split into W, and folded into B as before).

    python tools/bench/bench_pipeline_bubble.py --pp 4 --output /tmp/pipeline_bubble.json

Spawns ``--pp`` gloo processes on CPU, builds each layout with build_pipeline and runs training steps while
recording every action each stage executes, in order (F forward, B input-gradient, W weight-gradient, BW a
full backward) and its wall time. The bubble is then replayed from that order on a dependency graph
(F(s, m) after F(s-1, m); B(s, m) after F(s, m) and B(s+1, m); W(s, m) after B(s, m); each rank runs its
actions in its executed order, p2p free): idle fraction per rank = 1 - busy / makespan, under

- unit costs: F = B = W = 1 (a folded W, BW, costs B + W = 2 and the empty W 0);
- measured costs: each (stage, action) its median CPU wall time over the timed steps.

Also reports the extra bytes the FP8 split keeps between a B and its W (WgradDeferral.peak_bytes: the queued
FP8 dY^T plus the x^T that B would otherwise free), summed over a rank's chunks. CPU wall times of 4
processes on shared cores are noisy; the unit-cost column is the schedule's property.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from spawn_gloo import run_on_gloo  # beside this script

sys.path.insert(0, os.getcwd())  # run from the checkout's root

SCHEDULES = {"1f1b": None, "interleaved": 1, "interleaved-zb": 1, "zbv": None, "dualpipev": None}
PRECISIONS = {"fp32": (False, None), "fp32 torch split": (False, True), "fp8 split": (True, None),
              "fp8 folded": (True, False)}  # (fp8, split_weight_grads)


def _record(pipe, log: list) -> None:
    """Wrap every stage's actions: (kind, stage, micro-batch, seconds) appended in execution order."""
    for stage in pipe.schedule._stages if hasattr(pipe.schedule, "_stages") else [pipe.schedule._stage]:
        def timed(kind_of, real, stage_index=stage.stage_index):
            def run(chunk_id, *args, **kwargs):
                start = time.perf_counter()
                out = real(chunk_id, *args, **kwargs)
                log.append((kind_of(kwargs), stage_index, chunk_id, time.perf_counter() - start))
                return out
            return run
        stage.forward_one_chunk = timed(lambda kw: "F", stage.forward_one_chunk)
        stage.backward_one_chunk = timed(lambda kw: "BW" if kw.get("full_backward", True) else "B",
                                         stage.backward_one_chunk)
        stage.backward_weight_one_chunk = timed(lambda kw: "W", stage.backward_weight_one_chunk)


def _measure(rank: int, args) -> dict:
    from megafp8.fp8 import Fp8Recipe, invalidate_fp8_weight_caches
    from megafp8.model import ModelConfig
    from megafp8.parallel.parallel_state import ParallelState
    from megafp8.parallel.pipeline import build_pipeline
    import torch.distributed as dist

    pp, micro = args["pp"], args["microbatches"]
    cfg = ModelConfig(num_layers=2 * pp, hidden_size=args["hidden"], ffn_hidden_size=4 * args["hidden"],
                      num_attention_heads=4, seq_length=args["seq"], vocab_size=512, seed=1)
    results = {}
    for schedule, vpp in SCHEDULES.items():
        for precision, (fp8, split) in PRECISIONS.items():
            ps = ParallelState(world_size=pp, pipeline_model_parallel_size=pp, pipeline_schedule=schedule,
                               num_layers_per_virtual_pipeline_stage=vpp).init_process_groups()
            pipe = build_pipeline(cfg, ps, micro_batch_size=1, num_microbatches=micro,
                                  fp8_recipe=Fp8Recipe.delayed() if fp8 else None, split_weight_grads=split)
            ids = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_length), generator=torch.Generator().manual_seed(0))
            log: list = []
            for step in range(1 + args["steps"]):
                if step == 1:
                    _record(pipe, log)  # step 0 warms up (cold FP8 scales, allocator)
                pipe.step(ids, ids.roll(-1, 1))
                pipe.zero_grad()
                for chunk in pipe.chunks:
                    invalidate_fp8_weight_caches(chunk)
            held = sum(d.peak_bytes for d in pipe.deferrals)
            gathered = [None] * pp
            dist.all_gather_object(gathered, (log, held))
            results[f"{schedule}|{precision}"] = gathered
    return results


def replay(orders: list[list[tuple]], cost) -> list[float]:
    """Idle fraction per rank of running each rank's actions in order on the dependency graph."""
    done: dict[tuple, float] = {}
    free = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    pos = [0] * len(orders)
    last_stage = max(s for order in orders for _, s, _ in order)
    ends = {"F": "F", "B": "B", "BW": "B", "W": "W"}
    while any(p < len(o) for p, o in zip(pos, orders)):
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, s, m = order[pos[r]]
                deps = ([("F", s - 1, m)] if kind == "F" and s > 0 else []) + \
                    ([("F", s, m)] + ([("B", s + 1, m)] if s < last_stage else []) if kind in ("B", "BW") else []) + \
                    ([("B", s, m)] if kind == "W" else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                c = cost(kind, s)
                free[r] = start + c
                busy[r] += c
                done[(ends[kind], s, m)] = free[r]
                if kind == "BW":
                    done[("W", s, m)] = free[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("replay deadlocked: the recorded order is not a valid schedule")
    makespan = max(free)
    return [1 - b / makespan for b in busy]


UNIT = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}


def summarize(results: dict, steps: int) -> list[dict]:
    rows = []
    for key, per_rank in results.items():
        schedule, precision = key.split("|")
        logs = [log for log, _ in per_rank]
        per_step = [len(log) // steps for log in logs]
        orders = [[(k, s, m) for k, s, m, _ in log[:n]] for log, n in zip(logs, per_step)]
        times: dict[tuple, list[float]] = {}
        for log in logs:
            for k, s, _, t in log:
                times.setdefault((k, s), []).append(t)
        measured = {k: statistics.median(v) for k, v in times.items()}
        # Folded: B computes both gradients and W is empty (fp32's default, FP8 with the split off).
        folded = precision in ("fp32", "fp8 folded")
        unit = replay(orders, lambda k, s: (2.0 if k == "B" else 0.0 if k == "W" else UNIT[k]) if folded else UNIT[k])
        cpu = replay(orders, lambda k, s: measured[(k, s)])
        kinds = {k for o in orders for k, *_ in o}
        ms = {k: round(1e3 * statistics.median([t for (k2, _), v in times.items() if k2 == k for t in v]), 2)
              for k in sorted(kinds)}
        rows.append(dict(schedule=schedule, precision=precision, unit_idle=[round(x, 3) for x in unit],
                         cpu_idle=[round(x, 3) for x in cpu], action_ms=ms,
                         split_extra_bytes=[held for _, held in per_rank]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output", default=None)
    a = parser.parse_args()
    if a.pp < 2 or a.microbatches < a.pp:
        parser.error("--pp must be >= 2 and --microbatches >= --pp")
    results = run_on_gloo(_measure, a.pp, dict(pp=a.pp, microbatches=a.microbatches, hidden=a.hidden, seq=a.seq,
                                              steps=a.steps))
    rows = summarize(results, a.steps)
    print("| schedule | precision | idle per rank, F=B=W=1 | idle per rank, CPU-measured costs | median ms F / B / W / BW |"
          " extra bytes the split holds per rank |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['precision']} | {' / '.join(f'{x:.2f}' for x in r['unit_idle'])} | "
              f"{' / '.join(f'{x:.2f}' for x in r['cpu_idle'])} | "
              f"{' / '.join(f'{k} {v}' for k, v in r['action_ms'].items())} | "
              f"{' / '.join(str(b) for b in r['split_extra_bytes'])} |")
    if a.output:
        with open(a.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
