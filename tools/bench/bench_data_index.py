"""Benchmark GPT sample-index and blending-index building (megafp8's vectorized numpy vs Megatron-Core).

    python tools/bench/bench_data_index.py --output /tmp/bench_data_index.json

1. GPT indices (document, sample and shuffle index, one epoch, ``--seq-length``) over 10^8 and 10^9
   tokens of synthetic document lengths, uniform in [1, 2 * mean), nothing read from disk. The same
   inputs go through Megatron-Core's own builders (its ``_build_document_index`` and
   ``_build_shuffle_index`` and its compiled ``build_sample_idx``) when ``megatron.core`` imports, and
   the results are compared array for array.
2. Blending indices (Megatron's greedy interleave) for 2 and 10 datasets: megafp8's compiled helper,
   its pure-Python fallback (smaller sizes only) and Megatron-Core's C++ ``build_blending_indices``.
3. With ``--previous COMMIT``: the GPT indices of ``megafp8/data/gpt_dataset.py`` at that commit (loaded
   from git) against today's, alternated, on 10^9 tokens in 10^7 documents.

Times are the best of ``--repeats``; the machine's load average is recorded because shared machines
make single runs noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import importlib.util
import platform
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megafp8.data.blending_indices import greedy_blending_indices  # noqa: E402
from megafp8.data.gpt_dataset import build_indices  # noqa: E402


def _megatron():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import gpt_dataset, helpers
        return gpt_dataset, helpers
    except ImportError:
        return None


def _best(fn, repeats: int):
    """(best wall seconds, best CPU seconds of this process, result): on a shared machine the CPU time
    is the steadier number, since waiting for a core does not count."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus), result


def bench_gpt_index(total_tokens: int, mean_length: int, seq_length: int, repeats: int) -> dict:
    num_docs = total_tokens // mean_length
    lengths = np.random.default_rng(0).integers(1, 2 * mean_length, size=num_docs).astype(np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    documents = np.arange(num_docs, dtype=np.int32)
    seconds, cpu, ours = _best(lambda: build_indices(lengths, documents, None, seq_length, 1234), repeats)
    row = {"tokens": tokens, "documents": num_docs, "seq_length": seq_length, "samples": len(ours[1]) - 1,
           "ours_s": round(seconds, 4), "ours_cpu_s": round(cpu, 4)}
    megatron = _megatron()
    if megatron is not None:
        gpt_dataset, helpers = megatron

        def theirs():
            rng = np.random.RandomState(1234)
            document_index = gpt_dataset._build_document_index(documents, 1, rng, False)
            sample_index = helpers.build_sample_idx(lengths, document_index, seq_length, 1, tokens, True, True)
            total = sample_index.shape[0] - 1
            return document_index, sample_index, gpt_dataset._build_shuffle_index(total, total, rng)

        seconds, cpu, reference = _best(theirs, repeats)
        row["megatron_core_s"], row["megatron_core_cpu_s"] = round(seconds, 4), round(cpu, 4)
        row["identical"] = all(np.array_equal(a, b) for a, b in zip(ours, reference))
    print(json.dumps(row), flush=True)
    return row


def bench_blending(num_datasets: int, size: int, repeats: int, python_fallback: bool) -> dict:
    weights = np.random.default_rng(num_datasets).random(num_datasets)
    weights = (weights / weights.sum()).tolist()
    seconds, cpu, ours = _best(lambda: greedy_blending_indices(weights, size), repeats)
    row = {"datasets": num_datasets, "samples": size, "ours_compiled_s": round(seconds, 4), "ours_compiled_cpu_s": round(cpu, 4)}
    if python_fallback:
        seconds, cpu, slow = _best(lambda: greedy_blending_indices(weights, size, compiled=False), 1)
        row["ours_python_s"], row["ours_python_cpu_s"] = round(seconds, 4), round(cpu, 4)
        row["python_identical"] = bool(np.array_equal(slow[0], ours[0]))
    megatron = _megatron()
    if megatron is not None:
        def theirs():
            indices = (np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64))
            megatron[1].build_blending_indices(indices[0], indices[1], weights, num_datasets, size, False)
            return indices

        seconds, cpu, reference = _best(theirs, repeats)
        row["megatron_cpp_s"], row["megatron_cpp_cpu_s"] = round(seconds, 4), round(cpu, 4)
        row["identical"] = bool(np.array_equal(ours[0], reference[0]) and np.array_equal(ours[1], reference[1]))
    print(json.dumps(row), flush=True)
    return row


def bench_previous(commit: str, seq_length: int, repeats: int) -> dict:
    """Today's GPT indices against the implementation at ``commit``, alternated so load hits both alike."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    source = subprocess.run(["git", "show", f"{commit}:megafp8/data/gpt_dataset.py"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "previous_gpt_dataset.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location("previous_gpt_dataset", path)
        previous = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(previous)
    lengths = np.random.default_rng(0).integers(1, 200, size=10**7).astype(np.int32)
    num_samples = (int(lengths.sum(dtype=np.int64)) - 1) // seq_length

    def old():
        rng = np.random.default_rng(1234)
        document_index = previous.build_document_index(np.arange(len(lengths)), 1, rng)
        previous.build_sample_index(lengths, document_index, seq_length, num_samples)
        previous.build_shuffle_index(num_samples, rng)

    documents = np.arange(len(lengths), dtype=np.int32)
    row = {"commit": commit, "previous_s": [], "previous_cpu_s": [], "ours_s": [], "ours_cpu_s": []}
    for _ in range(repeats):
        for name, fn in (("previous", old), ("ours", lambda: build_indices(lengths, documents, None, seq_length, 1234))):
            wall, cpu, _ = _best(fn, 1)
            row[f"{name}_s"].append(round(wall, 3))
            row[f"{name}_cpu_s"].append(round(cpu, 3))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--previous", default=None, metavar="COMMIT",
                        help="also time the GPT indices of megafp8 at this git commit against today's")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
               "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
               "numpy": np.__version__, "command": " ".join(sys.argv), "loadavg_before": os.getloadavg()}
    results["gpt_index"] = [bench_gpt_index(total, mean, args.seq_length, args.repeats)
                            for total in (10**8, 10**9) for mean in (1000, 100)]
    results["blending"] = [bench_blending(d, size, args.repeats, python_fallback=size <= 10**6)
                           for d in (2, 10) for size in (10**6, 10**7, 10**8)]
    if args.previous:
        results["previous"] = bench_previous(args.previous, args.seq_length, args.repeats)
    results["loadavg_after"] = os.getloadavg()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
