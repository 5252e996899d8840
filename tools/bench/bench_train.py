"""End-to-end training benchmark: one model on the same synthetic tokens, high precision vs each FP8 recipe
vs the most compressed ZeRO preset, each run through the real entry (`python -m megafp8.pretrain`).

Each configuration is a fresh process that runs `megafp8.pretrain.main` with `--log-dir`; its
`metrics.jsonl` gives the per-iteration time (the first `--warmup` iterations are skipped: compiles,
allocator growth, the first FP8 scales) and model-state bytes/param; the process reports its own peak
memory (CUDA: `torch.cuda.max_memory_allocated`; CPU: the process's peak RSS, `ru_maxrss`, which includes
the Python/torch runtime). TFLOP/s come from `megafp8.training.flops` (docs/training.md) and MFU from the
dense BF16 and FP8 peaks of `megafp8.training.training_log.PEAK_TFLOPS`.

    python tools/bench/bench_train.py --quick          # CPU, tiny model, about a minute
    python tools/bench/bench_train.py                  # GPU: ~1B Llama (16 x 2048, FFN 8192, seq 2048), TP=1, bf16
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megafp8.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype  # noqa: E402
from megafp8.training.arguments import parse_args  # noqa: E402
from megafp8.training.flops import flops_per_iteration  # noqa: E402
from megafp8.training.megatron_flags import LLAMA_FLAGS  # noqa: E402
from megafp8.training.model_setup import model_config_from_args  # noqa: E402
from megafp8.training.training_log import device_peak_tflops  # noqa: E402

RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise")
ZERO_PRESET = ["--use-distributed-optimizer", "--fp8-param-gather", "--master-weight-dtype", "fp16",
               "--optimizer-state-dtype", "fp8", "--grad-reduce-in-bf16"]
# The child: the real entry in this process, then its own peak memory on one JSON line.
CHILD = """
import json, resource, sys, torch
from megafp8.pretrain import main
status = main(sys.argv[1:])
cuda = torch.cuda.is_available()
peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("BENCH_TRAIN_MEMORY " + json.dumps({"peak_bytes": peak, "kind": "cuda_max_allocated" if cuda else "ru_maxrss"}))
sys.exit(status)
"""


# Host-overhead modes (docs/training.md "Compile and CUDA graphs"): run by exact name through --only, e.g.
# "fp8 delayed + compile"; a plain run (no --only) runs the eager configurations.
MODES = {" + compile": ["--compile"], " + cuda graph": ["--enable-cuda-graph"]}


def configurations(high_precision: list[str], modes: bool = False) -> list[tuple[str, list[str]]]:
    """(name, flags) of every run: high precision, each recipe (hybrid format), the compressed ZeRO preset; with
    `modes`, also high precision and FP8 delayed compiled and CUDA-graphed (is FP8 faster than BF16 once the host
    is out of the way?)."""
    high = "high precision" + (" (bf16)" if high_precision else " (fp32)")
    runs = [(high, high_precision)]
    runs += [(f"fp8 {recipe}", [*high_precision, "--fp8-format", "hybrid", "--fp8-recipe", recipe]) for recipe in RECIPES]
    runs.append(("fp8 delayed + ZeRO fp8 preset", [*high_precision, "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                                                   *ZERO_PRESET]))
    if modes:
        base = [(high, high_precision), ("fp8 delayed", runs[1][1])]
        runs += [(name + suffix, [*flags, *extra]) for suffix, extra in MODES.items() for name, flags in base]
    return runs


def model_flags(quick: bool, iters: int) -> list[str]:
    if quick:
        shape = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "384", "--num-attention-heads", "4",
                 "--seq-length", "128", "--micro-batch-size", "2"]
    else:  # Llama-3.2-1B's transformer (1.04B parameters with this 32k tied vocabulary), 8 x 2048 = 16k
        # tokens per step: enough GEMM work that the step measures the model, not the optimizer
        shape = ["--num-layers", "16", "--hidden-size", "2048", "--ffn-hidden-size", "8192", "--num-attention-heads",
                 "32", "--group-query-attention", "--num-query-groups", "8", "--seq-length", "2048",
                 "--micro-batch-size", "8"]
    # delayed scaling over a 1024-amax history (max), beta2 0.95 and a cosine decay, as these rows always measured
    return [*LLAMA_FLAGS, *shape, "--train-iters", str(iters), "--lr", "1e-4", "--lr-warmup-iters", "1",
            "--lr-decay-style", "cosine", "--adam-beta2", "0.95", "--fp8-amax-history-len", "1024",
            "--fp8-amax-compute-algo", "max", "--eval-iters", "0", "--log-interval", "1", "--split", "100,0,0",
            "--seed", "1234"]


def write_synthetic_tokens(prefix: str, vocab_size: int, num_tokens: int, seed: int = 0) -> None:
    """Uniform random token ids in 64 documents: every configuration reads exactly these."""
    tokens = np.random.default_rng(seed).integers(0, vocab_size, num_tokens)
    with IndexedDatasetWriter(prefix, optimal_dtype(vocab_size + 1)) as writer:
        writer.add_documents(tokens, np.full(64, num_tokens // 64, dtype=np.int32))
        writer.finalize()


def run_one(flags: list[str], log_dir: Path, timeout: float) -> tuple[list[dict], dict]:
    """(training records of metrics.jsonl, peak memory) of one run of the entry."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("OMP_NUM_THREADS", "1")
    result = subprocess.run([sys.executable, "-c", CHILD, *flags, "--log-dir", str(log_dir)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"megafp8.pretrain {' '.join(flags)} failed (exit {result.returncode}):\n"
                           f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    memory = next(json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
                  if line.startswith("BENCH_TRAIN_MEMORY "))
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "lm_loss" in r], memory


def keep_trace(trace: Path, directory: str, name: str) -> None:
    """The run's Chrome trace, gzipped, as <directory>/<configuration name as a file name>.json.gz."""
    os.makedirs(directory, exist_ok=True)
    slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
    with open(trace, "rb") as source, gzip.open(Path(directory) / f"{slug}.json.gz", "wb") as target:
        shutil.copyfileobj(source, target)


def summarize(name: str, flags: list[str], records: list[dict], memory: dict, warmup: int, vocab_size: int,
              peak: tuple[float, float] | None) -> dict:
    args = parse_args(flags, world_size=1)
    config = model_config_from_args(args, vocab_size)
    flops = flops_per_iteration(args.global_batch_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
                                ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                                num_query_groups=args.num_query_groups, seq_length=args.seq_length,
                                padded_vocab_size=config.padded_vocab_size(1))
    timed = [r for r in records if r["iteration"] > warmup]
    seconds = sum(r["elapsed_ms_per_iteration"] for r in timed) / len(timed) / 1e3
    tflops = flops / seconds / 1e12
    return {
        "name": name, "flags": flags, "timed_iterations": len(timed), "seconds_per_iteration": seconds,
        "tokens_per_s": args.global_batch_size * args.seq_length / seconds, "tflops": tflops,
        "mfu_bf16": tflops / peak[0] if peak else None, "mfu_fp8": tflops / peak[1] if peak else None,
        "peak_memory_bytes": memory["peak_bytes"], "peak_memory_kind": memory["kind"],
        "model_state_bytes_per_param": timed[-1]["model_state_bytes_per_param"],
        "final_lm_loss": timed[-1]["lm_loss"],
    }


def markdown(rows: list[dict]) -> str:
    measured = [r for r in rows if "error" not in r]
    if not measured:
        return "| run | result |\n|---|---|\n" + "\n".join(f"| {r['name']} | failed: {r['error']} |" for r in rows)
    memory_label = ("peak memory (GiB, cuda max allocated)" if measured[0]["peak_memory_kind"] == "cuda_max_allocated"
                    else "peak RSS (MiB, ru_maxrss, whole process)")
    scale = 2**30 if measured[0]["peak_memory_kind"] == "cuda_max_allocated" else 2**20
    base = rows[0]["tokens_per_s"] if "error" not in rows[0] else None
    lines = [f"| run | tokens/s | vs high precision | TFLOP/s | MFU vs BF16 / FP8 peak | {memory_label} | "
             "model-state bytes/param | loss at last iteration |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a"
        mfu = f"{100 * r['mfu_bf16']:.1f}% / {100 * r['mfu_fp8']:.1f}%" if r["mfu_bf16"] is not None else "n/a (no GPU peak)"
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.1f} | {ratio} | {r['tflops']:.4f} | "
                     f"{mfu} | {r['peak_memory_bytes'] / scale:.1f} | {r['model_state_bytes_per_param']:.3f} | "
                     f"{'non-finite' if r['final_lm_loss'] is None else format(r['final_lm_loss'], '.4f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized model (about a minute)")
    parser.add_argument("--iters", type=int, default=None, help="iterations per run (default: 8 quick, 10 GPU)")
    parser.add_argument("--warmup", type=int, default=None, help="leading iterations not timed (default: 3)")
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only these configurations, by exact name (see --list)")
    parser.add_argument("--list", action="store_true", help="print the configuration names and exit")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    parser.add_argument("--compile-timeout", type=float, default=None,
                        help="seconds allowed per compiled or CUDA-graphed run (default: twice --timeout)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--profile-dir", default=None,
                        help="each run trains one more, untimed iteration under --profile and its Chrome trace is "
                             "kept here as <configuration>.json.gz")
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    names = [name for name, _ in configurations(["--bf16"] if cuda else [], modes=True)]
    if args.list:
        print("\n".join(names))
        return 0
    unknown = [o for o in args.only or [] if o not in names]
    if unknown:
        parser.error(f"--only {', '.join(map(repr, unknown))}: not a configuration; choose from {', '.join(map(repr, names))}")
    if not args.quick and not cuda:
        parser.error("the default (~1B) configuration needs a CUDA GPU; use --quick on CPU")
    iters = args.iters or (8 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else 3
    if not 0 <= warmup < iters:
        parser.error(f"--warmup ({warmup}) must leave at least one of --iters ({iters}) timed")
    vocab = 1000 if args.quick else 32000
    device = torch.cuda.get_device_name() if cuda else "CPU"
    peak = device_peak_tflops(device) if cuda else None
    with tempfile.TemporaryDirectory(prefix="bench_train_") as scratch:
        prefix = str(Path(scratch) / "synthetic")
        # With --profile-dir one more iteration runs after the timed ones, under the profiler, and is not timed.
        base = model_flags(args.quick, iters + 1 if args.profile_dir else iters)
        profile = (["--profile", "--profile-step-start", str(iters), "--profile-step-end", str(iters + 1)]
                   if args.profile_dir else [])
        seq, batch = int(base[base.index("--seq-length") + 1]), int(base[base.index("--micro-batch-size") + 1])
        write_synthetic_tokens(prefix, vocab, num_tokens=64 * (seq + 1) * (4 + iters * batch // 64))
        data = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)]
        rows, failed = [], 0
        for i, (name, extra) in enumerate(configurations(["--bf16"] if cuda else [], modes=bool(args.only))):
            if args.only and name not in args.only:
                continue
            compiled = any(name.endswith(suffix) for suffix in MODES)
            timeout = (args.compile_timeout or 2 * args.timeout) if compiled else args.timeout
            flags = [*base, *data, *extra]
            try:  # one failed or timed-out run is a row of its own; the others still run
                log_dir = Path(scratch) / f"logs{i}"
                records, memory = run_one([*flags, *profile], log_dir, timeout)
                rows.append(summarize(name, flags, records[:iters], memory, warmup, vocab + 1, peak))
                if args.profile_dir:
                    keep_trace(log_dir / "profile" / f"rank0.iter{iters + 1}-{iters + 1}.json", args.profile_dir, name)
                print(f"# {name}: {rows[-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                failed += 1
                rows.append({"name": name, "flags": flags, "error": str(err).splitlines()[0][:200]})
                print(f"# {name}: FAILED {rows[-1]['error']}\n{str(err)[-2000:]}", file=sys.stderr, flush=True)
            if args.json:  # after every run: a run cut short by a timeout still leaves the finished rows
                Path(args.json).write_text(json.dumps({"device": device, "iters": iters, "warmup": warmup,
                                                       "rows": rows}, indent=1))
    print(f"bench_train: {device}, {iters} iterations per run, first {warmup} untimed, "
          f"model flags: {' '.join(base)}\n")
    print(markdown(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
