"""Streaming, multiprocess jsonl → Megatron indexed dataset conversion (the engine of tools/preprocess_data.py).

The main process never reads the documents: it cuts the input into ~1 MiB byte ranges that end on line
boundaries and hands the ranges to worker processes. A worker reads its range, parses and validates each
line, tokenizes the whole batch in one call and returns flat numpy arrays (tokens + lengths), so what
crosses the process boundary is a few large buffers rather than millions of Python ints. The main
process appends them, in input order, to the output, which is renamed into place only when complete.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from megafp8.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype
from megafp8.data.tokenizer import Tokenizer, build_tokenizer

# What each kind of bad line is called in reports; a bad line is skipped (or fatal with --strict).
PROBLEM_KINDS = {
    "not_utf8": "not valid UTF-8",
    "malformed_json": "malformed JSON",
    "missing_key": "missing key",
    "not_string": "value is not a string",
    "empty": "empty document",
}
_EXAMPLES_PER_KIND = 5
_CHUNK_BYTES = 1 << 20


class PreprocessError(ValueError):
    """Bad input under ``--strict``, or bad arguments; the message names the file, line or flag."""


@dataclass
class ChunkResult:
    index: int
    num_lines: int
    num_bytes: int
    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    # (kind, line number within the chunk starting at 0, detail); only the first few per kind.
    problems: list[tuple[str, int, str]]
    problem_counts: Counter


@dataclass
class PreprocessSummary:
    output_prefixes: dict[str, str]
    documents: dict[str, int]
    tokens: dict[str, int]
    lines: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problem_counts: Counter = field(default_factory=Counter)
    problem_examples: dict[str, list[tuple[int, str]]] = field(default_factory=dict)

    def report(self, input_path: str) -> str:
        """Human-readable summary of skipped lines, with the first line numbers of each kind."""
        if not self.problem_counts:
            return f"{input_path}: no bad lines"
        parts = []
        for kind, count in sorted(self.problem_counts.items()):
            examples = ", ".join(f"line {n} ({detail})" for n, detail in self.problem_examples.get(kind, []))
            parts.append(f"  {count} x {PROBLEM_KINDS[kind]}: {examples}{' ...' if count > _EXAMPLES_PER_KIND else ''}")
        total = sum(self.problem_counts.values())
        return f"{input_path}: skipped {total} bad document(s) (use --strict to fail instead):\n" + "\n".join(parts)


# ---------------------------------------------------------------------------------------------------
# Byte ranges
# ---------------------------------------------------------------------------------------------------

def _line_start_at_or_after(f, position: int) -> int:
    """The first line start >= position (a line belongs to the range holding its first byte)."""
    if position <= 0:
        return 0
    f.seek(position - 1)
    f.readline()
    return f.tell()


def partition_range(path: str, partitions: int, partition_index: int) -> tuple[int, int]:
    """Byte range of partition ``partition_index`` of ``partitions`` equal slices, on line boundaries."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        start = _line_start_at_or_after(f, size * partition_index // partitions)
        end = _line_start_at_or_after(f, size * (partition_index + 1) // partitions)
    return start, min(end, size)


def iter_chunks(path: str, start: int, end: int, chunk_bytes: int = _CHUNK_BYTES) -> Iterator[tuple[int, int, int]]:
    """(index, start, end) of ~chunk_bytes ranges covering [start, end), each ending after a newline."""
    with open(path, "rb") as f:
        index = 0
        while start < end:
            stop = min(_line_start_at_or_after(f, start + chunk_bytes), end)
            yield index, start, stop
            index += 1
            start = stop


def count_lines_before(path: str, position: int) -> int:
    """Newlines before ``position``: turns a partition's local line numbers into the file's."""
    count = 0
    with open(path, "rb") as f:
        while position > 0:
            block = f.read(min(position, 16 << 20))
            if not block:
                break
            count += block.count(b"\n")
            position -= len(block)
    return count


# ---------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------

_worker_state: dict = {}


def _init_worker(tokenizer: Tokenizer, path: str, json_keys: Sequence[str], append_eod: bool, dtype: np.dtype) -> None:
    _worker_state.update(tokenizer=tokenizer, path=path, json_keys=list(json_keys), append_eod=append_eod, dtype=dtype)


def encode_chunk(task: tuple[int, int, int]) -> ChunkResult:
    """Read, validate and tokenize the lines of one byte range (runs in a worker process)."""
    index, start, end = task
    state = _worker_state
    keys: list[str] = state["json_keys"]
    with open(state["path"], "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the text after the final newline is not a line

    problems: list[tuple[str, int, str]] = []
    counts: Counter = Counter()

    def problem(kind: str, line: int, detail: str) -> None:
        counts[kind] += 1
        if counts[kind] <= _EXAMPLES_PER_KIND:
            problems.append((kind, line, detail))

    texts: dict[str, list[str]] = {key: [] for key in keys}
    text_lines: dict[str, list[int]] = {key: [] for key in keys}
    for line_number, raw in enumerate(lines):
        if not raw or raw.isspace():
            continue  # blank lines (e.g. a trailing one) hold no document and are not an error
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problem("not_utf8", line_number, f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}")
            continue
        try:
            record = json.loads(decoded)
        except ValueError as exc:
            problem("malformed_json", line_number, str(exc))
            continue
        if not isinstance(record, dict):
            problem("malformed_json", line_number, f"a JSON {type(record).__name__}, not an object")
            continue
        for key in keys:
            value = record.get(key)
            if value is None and key not in record:
                problem("missing_key", line_number, repr(key))
            elif not isinstance(value, str):
                problem("not_string", line_number, f"{key!r} is {type(value).__name__}")
            elif not value:
                problem("empty", line_number, repr(key))
            else:
                texts[key].append(value)
                text_lines[key].append(line_number)

    tokens, lengths = {}, {}
    tokenizer: Tokenizer = state["tokenizer"]
    for key in keys:
        ids = tokenizer.tokenize_batch(texts[key]) if texts[key] else []
        key_lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        if len(ids) and not key_lengths.all():
            # Text that tokenizes to nothing would become a document of only an EOD: skip it as empty.
            keep = np.flatnonzero(key_lengths)
            for i in np.flatnonzero(key_lengths == 0):
                problem("empty", text_lines[key][i], f"{key!r} has no tokens")
            ids = [ids[i] for i in keep]
            key_lengths = key_lengths[keep]
        flat = np.fromiter(chain.from_iterable(ids), dtype=state["dtype"], count=int(key_lengths.sum()))
        if state["append_eod"] and len(ids):
            # Insert the EOD after each document in one vectorized call instead of per-list appends.
            flat = np.insert(flat, np.cumsum(key_lengths), tokenizer.eod)
            key_lengths = key_lengths + 1
        tokens[key] = flat
        lengths[key] = key_lengths.astype(np.int32)
    return ChunkResult(index, len(lines), end - start, tokens, lengths, problems, counts)


# ---------------------------------------------------------------------------------------------------
# Main side
# ---------------------------------------------------------------------------------------------------

def preprocess(
    input_path: str,
    output_prefix: str,
    tokenizer: Tokenizer,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    strict: bool = False,
    partitions: int = 1,
    partition_index: int | None = None,
    log_interval: int = 10000,
    progress: bool | None = None,
    chunk_bytes: int = _CHUNK_BYTES,
) -> PreprocessSummary:
    """Tokenize ``input_path`` into ``{output_prefix}_{key}_document.bin/.idx`` for every key."""
    if not os.path.isfile(input_path):
        raise PreprocessError(f"--input {input_path}: no such file")
    if workers < 1:
        raise PreprocessError(f"--workers {workers}: must be at least 1")
    if partitions < 1 or (partition_index is not None and not 0 <= partition_index < partitions):
        raise PreprocessError(f"--partition-index {partition_index} must be in [0, --partitions {partitions})")
    if append_eod and tokenizer.eod is None:
        raise PreprocessError("--append-eod: the tokenizer has no end-of-document (eos) token")
    if not json_keys:
        raise PreprocessError("--json-keys: give at least one key")

    # Without --partition-index the whole file is streamed; --partitions then only exists for Megatron
    # command-line compatibility (the output is the same as with one partition).
    if partition_index is None:
        start, end = 0, os.path.getsize(input_path)
        line_base = 1
    else:
        start, end = partition_range(input_path, partitions, partition_index)
        line_base = 1 + count_lines_before(input_path, start)

    dtype = optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    summary = PreprocessSummary(prefixes, {k: 0 for k in json_keys}, {k: 0 for k in json_keys})
    writers = {key: IndexedDatasetWriter(prefix, dtype) for key, prefix in prefixes.items()}
    init_args = (tokenizer, input_path, list(json_keys), append_eod, dtype)
    chunks = iter_chunks(input_path, start, end, chunk_bytes)

    pool = None
    if workers > 1:
        # fork: workers inherit the loaded tokenizer instead of re-importing; created before tqdm starts
        # its monitor thread, since forking a threaded process is fragile.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        pool = multiprocessing.get_context(method).Pool(workers, initializer=_init_worker, initargs=init_args)
        results = _ordered_results(pool, chunks, in_flight=2 * workers)
    else:
        _init_worker(*init_args)
        results = map(encode_chunk, chunks)

    begin = time.perf_counter()
    # progress None: a bar on a terminal, plain log lines every log_interval documents in a batch job's log.
    interactive = progress if progress is not None else sys.stderr.isatty()
    log_lines = progress is None and not interactive
    bar = tqdm(total=end - start, unit="B", unit_scale=True, desc="preprocess", disable=not interactive)
    docs_at_last_log = 0
    try:
        for result in results:
            _check_and_collect(result, line_base, summary, strict, input_path)
            for key in json_keys:
                writers[key].add_documents(result.tokens[key], result.lengths[key])
                summary.documents[key] += len(result.lengths[key])
                summary.tokens[key] += result.tokens[key].size
            line_base += result.num_lines
            summary.lines += result.num_lines
            summary.bytes += result.num_bytes
            bar.update(result.num_bytes)
            docs = summary.documents[json_keys[0]]
            if interactive:  # tqdm redraws at its own pace; the postfix only has to be current
                bar.set_postfix_str(_rates(summary, json_keys[0], time.perf_counter() - begin), refresh=False)
            elif log_lines and docs - docs_at_last_log >= log_interval:
                docs_at_last_log = docs
                print(f"processed {docs:,} documents: {_rates(summary, json_keys[0], time.perf_counter() - begin)}",
                      flush=True)
        for writer in writers.values():
            writer.finalize()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    summary.seconds = time.perf_counter() - begin
    return summary


def _ordered_results(pool, chunks: Iterator, in_flight: int) -> Iterator[ChunkResult]:
    """Results in input order with at most ``in_flight`` chunks queued (bounded memory on huge inputs)."""
    pending: deque = deque()
    for task in chunks:
        pending.append(pool.apply_async(encode_chunk, (task,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _check_and_collect(result: ChunkResult, line_base: int, summary: PreprocessSummary, strict: bool, path: str) -> None:
    if strict and result.problem_counts:
        kind, line, detail = min(result.problems, key=lambda p: p[1])
        raise PreprocessError(
            f"{path}:{line_base + line}: {PROBLEM_KINDS[kind]}" + (f": {detail}" if detail else "")
            + " (--strict stops at the first bad line; drop it to skip bad lines instead)"
        )
    summary.problem_counts.update(result.problem_counts)
    for kind, line, detail in result.problems:
        examples = summary.problem_examples.setdefault(kind, [])
        if len(examples) < _EXAMPLES_PER_KIND:
            examples.append((line_base + line, detail))


def _rates(summary: PreprocessSummary, key: str, seconds: float) -> str:
    seconds = max(seconds, 1e-9)
    return (
        f"{summary.documents[key] / seconds:,.0f} docs/s, {summary.tokens[key] / seconds:,.0f} tokens/s, "
        f"{summary.bytes / seconds / 1e6:.1f} MB/s"
    )


def format_summary(summary: PreprocessSummary, key: str) -> str:
    """One-line account of a finished run, for the tool's last line of output."""
    return (
        f"wrote {summary.output_prefixes[key]}.bin/.idx: {summary.documents[key]:,} documents, "
        f"{summary.tokens[key]:,} tokens from {summary.lines:,} lines in {summary.seconds:.1f} s "
        f"({_rates(summary, key, summary.seconds)})"
    )


def tokenizer_from_args(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None) -> Tokenizer:
    """build_tokenizer with its ValueError turned into the tool's error type."""
    try:
        return build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)
    except ValueError as exc:
        raise PreprocessError(str(exc)) from None
