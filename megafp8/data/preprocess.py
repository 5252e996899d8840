"""Streaming jsonl → Megatron indexed dataset conversion (the engine of tools/preprocess_data.py).

The input is cut into ~1 MiB byte ranges that end on line boundaries. Each range is parsed and validated
in Python, then tokenized as one batch, and its tokens are appended, in input order, to the output, which
is renamed into place only when complete. Memory holds a few ranges at a time, whatever the input size.

Tokenizers whose batch encode runs in native threads with the GIL released (SentencePiece, HuggingFace
``tokenizers``) work in one process: the main thread reads and parses range k+1 while a tokenizing thread
encodes range k with ``workers`` native threads, the way SentencePiece's own batched encode would. Other
tokenizers (NullTokenizer, transformers' Python tokenizers) run in ``workers`` processes that each read,
parse and tokenize whole ranges and return two flat numpy arrays. Both give byte-identical output.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
    "untokenizable": "the tokenizer refused it",
}
_EXAMPLES_PER_KIND = 5
_CHUNK_BYTES = 1 << 20
# Leading bytes of compressed files people pass by mistake (a .jsonl.gz, say).
_COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}


class PreprocessError(ValueError):
    """Bad input under ``--strict``, or bad arguments; the message names the file, line or flag."""


@dataclass
class ParsedChunk:
    """The documents of one byte range, per key, with the bad lines found while parsing."""
    index: int
    num_lines: int
    num_bytes: int
    texts: dict[str, list[str]]
    text_lines: dict[str, list[int]]  # line number (within the chunk, from 0) of each text
    problems: list[tuple[str, int, str]]  # (kind, line within the chunk, detail); the first few per kind
    problem_counts: Counter


@dataclass
class ChunkResult:
    index: int
    num_lines: int
    num_bytes: int
    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
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


def _read_range(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


# ---------------------------------------------------------------------------------------------------
# Parsing and tokenizing one range
# ---------------------------------------------------------------------------------------------------

def parse_chunk(index: int, data: bytes, keys: Sequence[str]) -> ParsedChunk:
    """Split a range into lines, decode and validate each, and collect the texts under ``keys``."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the text after the final newline is not a line
    parsed = ParsedChunk(index, len(lines), len(data), {k: [] for k in keys}, {k: [] for k in keys}, [], Counter())
    for line_number, raw in enumerate(lines):
        if not raw or raw.isspace():
            continue  # blank lines (e.g. a trailing one) hold no document and are not an error
        first = raw.lstrip()[:1]
        if first != b"{":  # not an object: say so without building a (possibly huge) array or value first
            what = {b"[": "a JSON list, not an object", b'"': "a JSON string, not an object"}
            _problem(parsed, "malformed_json", line_number, what.get(first, "not a JSON object"))
            continue
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            _problem(parsed, "not_utf8", line_number, f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}")
            continue
        try:
            record = json.loads(decoded)
        except ValueError as exc:
            _problem(parsed, "malformed_json", line_number, str(exc))
            continue
        except RecursionError:  # e.g. 200,000 '[': valid JSON nests too deep for the parser
            _problem(parsed, "malformed_json", line_number, "nested too deeply")
            continue
        if not isinstance(record, dict):
            _problem(parsed, "malformed_json", line_number, f"a JSON {type(record).__name__}, not an object")
            continue
        for key in keys:
            value = record.get(key)
            if value is None and key not in record:
                present = ", ".join(map(repr, list(record)[:5])) or "none"
                _problem(parsed, "missing_key", line_number, f"{key!r}; keys present: {present}")
            elif not isinstance(value, str):
                _problem(parsed, "not_string", line_number, f"{key!r} is {type(value).__name__}")
            elif not value:
                _problem(parsed, "empty", line_number, repr(key))
            elif not value.isascii() and not _encodable(value):
                _problem(parsed, "not_utf8", line_number, f"{key!r} holds a lone surrogate (valid JSON, not text)")
            else:
                parsed.texts[key].append(value)
                parsed.text_lines[key].append(line_number)
    return parsed


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _tokenizable(parsed: ParsedChunk, key: str, tokenizer: Tokenizer) -> None:
    """After the batch encode failed: try each text alone, and turn those the tokenizer refuses into problems
    (skipped, or fatal under --strict) instead of one traceback for the whole range."""
    keep = []
    for text, line in zip(parsed.texts[key], parsed.text_lines[key]):
        try:
            tokenizer.tokenize(text)
            keep.append((text, line))
        except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
            _problem(parsed, "untokenizable", line, f"{key!r}: {str(exc)[:200]}")
    parsed.texts[key] = [text for text, _ in keep]
    parsed.text_lines[key] = [line for _, line in keep]


def _problem(chunk: ParsedChunk, kind: str, line: int, detail: str) -> None:
    chunk.problem_counts[kind] += 1
    if chunk.problem_counts[kind] <= _EXAMPLES_PER_KIND:
        chunk.problems.append((kind, line, detail))


def _encode(texts: Sequence[str], tokenizer: Tokenizer, dtype: np.dtype, num_threads: int):
    if not texts:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    return tokenizer.tokenize_arrays(texts, num_threads)


def tokenize_chunk(parsed: ParsedChunk, tokenizer: Tokenizer, append_eod: bool, dtype: np.dtype,
                   num_threads: int = 1) -> ChunkResult:
    """Tokenize every text of a parsed range in one batch per key; flat tokens + lengths per key."""
    tokens, lengths = {}, {}
    for key in parsed.texts:
        try:
            flat, key_lengths = _encode(parsed.texts[key], tokenizer, dtype, num_threads)
        except (ValueError, TypeError, OverflowError, RuntimeError):
            _tokenizable(parsed, key, tokenizer)
            flat, key_lengths = _encode(parsed.texts[key], tokenizer, dtype, num_threads)
        if len(key_lengths) and not key_lengths.all():
            # Text that tokenizes to nothing would become a document of only an EOD: skip it as empty.
            for i in np.flatnonzero(key_lengths == 0):
                _problem(parsed, "empty", parsed.text_lines[key][i], f"{key!r} has no tokens")
            key_lengths = key_lengths[key_lengths > 0]
        flat = flat.astype(dtype, copy=False)
        if append_eod and len(key_lengths):
            # Insert the EOD after each document in one vectorized call instead of per-list appends.
            flat = np.insert(flat, np.cumsum(key_lengths), tokenizer.eod)
            key_lengths = key_lengths + 1
        tokens[key] = flat
        lengths[key] = key_lengths.astype(np.int32)
    return ChunkResult(parsed.index, parsed.num_lines, parsed.num_bytes, tokens, lengths, parsed.problems,
                       parsed.problem_counts)


# ---------------------------------------------------------------------------------------------------
# The two ways of running ranges: one process with a tokenizing thread, or worker processes
# ---------------------------------------------------------------------------------------------------

def _threaded_results(path: str, chunks: Iterator, keys: Sequence[str], tokenizer: Tokenizer, append_eod: bool,
                      dtype: np.dtype, threads: int) -> Iterator[ChunkResult]:
    """Parse here while one thread runs the tokenizer's natively parallel batch encode on the previous range."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    pending: deque = deque()
    try:
        for index, start, end in chunks:
            parsed = parse_chunk(index, _read_range(path, start, end), keys)
            pending.append(executor.submit(tokenize_chunk, parsed, tokenizer, append_eod, dtype, threads))
            # One range encoding, one parsed and queued: the encoder never waits, memory stays bounded.
            if len(pending) > 2:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


_worker_state: dict = {}


def _init_worker(tokenizer: Tokenizer, path: str, json_keys: Sequence[str], append_eod: bool, dtype: np.dtype) -> None:
    _worker_state.update(tokenizer=tokenizer, path=path, json_keys=list(json_keys), append_eod=append_eod, dtype=dtype)


def encode_chunk(task: tuple[int, int, int]) -> ChunkResult:
    """Read, validate and tokenize the lines of one byte range (runs in a worker process)."""
    index, start, end = task
    state = _worker_state
    parsed = parse_chunk(index, _read_range(state["path"], start, end), state["json_keys"])
    return tokenize_chunk(parsed, state["tokenizer"], state["append_eod"], state["dtype"])


def _ordered_results(pool, chunks: Iterator, in_flight: int) -> Iterator[ChunkResult]:
    """Results in input order with at most ``in_flight`` chunks queued (bounded memory on huge inputs)."""
    pending: deque = deque()
    for task in chunks:
        pending.append(pool.apply_async(encode_chunk, (task,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


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
    use_threads: bool | None = None,
) -> PreprocessSummary:
    """Tokenize ``input_path`` into ``{output_prefix}_{key}_document.bin/.idx`` for every key.

    ``use_threads`` None picks the tokenizing thread when the tokenizer encodes batches in native threads
    (``tokenizer.native_batch_threads``) and worker processes otherwise; True/False force one way.
    """
    check_input_file(input_path)
    if workers < 1:
        raise PreprocessError(f"--workers {workers}: must be at least 1")
    if partitions < 1 or (partition_index is not None and not 0 <= partition_index < partitions):
        raise PreprocessError(f"--partition-index {partition_index} must be in [0, --partitions {partitions})")
    if append_eod and tokenizer.eod is None:
        raise PreprocessError("--append-eod: the tokenizer has no end-of-document (eos) token")
    if not json_keys:
        raise PreprocessError("--json-keys: give at least one key")
    repeated = sorted({key for key in json_keys if list(json_keys).count(key) > 1})
    if repeated:  # each key writes one dataset: a repeated key would write every document twice
        raise PreprocessError(f"--json-keys {' '.join(json_keys)}: {', '.join(map(repr, repeated))} given more than once")
    check_output_prefix(output_prefix)
    for key in json_keys:  # a tool never writes over its own input
        for suffix in (".bin", ".idx"):
            output = f"{output_prefix}_{key}_document{suffix}"
            if os.path.realpath(output) == os.path.realpath(input_path):
                raise PreprocessError(f"--output-prefix {output_prefix} would write {output}, which is --input; "
                                      "choose another prefix")

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
    try:
        writers = {key: IndexedDatasetWriter(prefix, dtype) for key, prefix in prefixes.items()}
    except OSError as exc:
        raise PreprocessError(f"--output-prefix {output_prefix}: cannot write there ({exc})") from None
    chunks = iter_chunks(input_path, start, end, chunk_bytes)
    threaded = tokenizer.native_batch_threads if use_threads is None else use_threads

    pool = None
    if threaded:
        results = _threaded_results(input_path, chunks, json_keys, tokenizer, append_eod, dtype, workers)
    elif workers > 1:
        init_args = (tokenizer, input_path, list(json_keys), append_eod, dtype)
        # fork: workers inherit the loaded tokenizer instead of re-importing; created before tqdm starts
        # its monitor thread, since forking a threaded process is fragile.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        pool = multiprocessing.get_context(method).Pool(workers, initializer=_init_worker, initargs=init_args)
        results = _ordered_results(pool, chunks, in_flight=2 * workers)
    else:
        _init_worker(tokenizer, input_path, list(json_keys), append_eod, dtype)
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
        for key in json_keys:
            if summary.documents[key] == 0:
                raise PreprocessError(_no_documents_message(input_path, key, summary, partition_index, partitions))
        for writer in writers.values():
            writer.finalize()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        bar.close()
        if hasattr(results, "close"):
            results.close()  # stops the tokenizing thread after a --strict error or an interrupt
        if pool is not None:
            pool.terminate()
            pool.join()
    summary.seconds = time.perf_counter() - begin
    return summary


def check_input_file(path: str) -> None:
    """Fail early, naming the cause, on an --input that cannot hold JSON lines."""
    if os.path.isdir(path):
        raise PreprocessError(f"--input {path}: is a directory; give one jsonl file (run once per file, or "
                              "concatenate them)")
    if not os.path.isfile(path):
        raise PreprocessError(f"--input {path}: no such file")
    with open(path, "rb") as f:
        head = f.read(64 << 10)
    if not head:
        raise PreprocessError(f"--input {path}: the file is empty, so there are no documents to write")
    for magic, name in _COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            raise PreprocessError(f"--input {path}: {name}-compressed data; decompress it first (one JSON "
                                  "object per line, UTF-8)")
    nul = head.find(b"\x00")
    if nul >= 0:  # JSON text never holds a raw NUL byte (strings must escape control characters)
        raise PreprocessError(f"--input {path}: binary data (a NUL byte at offset {nul}), not JSON lines; "
                              "UTF-16 text must be converted to UTF-8")


def check_output_prefix(output_prefix: str, flag: str = "--output-prefix") -> None:
    """The prefix's directory must exist or be creatable: no file may sit where a directory is needed."""
    parent = os.path.dirname(os.path.abspath(output_prefix))
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise PreprocessError(f"{flag} {output_prefix}: {existing} is a file, so the directory {parent} "
                              "cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PreprocessError(f"{flag} {output_prefix}: {existing} is not writable")


def _no_documents_message(path: str, key: str, summary: PreprocessSummary, partition_index: int | None,
                          partitions: int) -> str:
    where = f"--input {path}" + (f" (partition {partition_index} of {partitions})" if partition_index is not None else "")
    if not summary.problem_counts:
        if summary.lines == 0:
            return f"{where}: no lines in this range, so no documents; use fewer --partitions"
        return f"{where}: only blank lines, so no documents to write; nothing was written"
    report = summary.report(path).split("\n", 1)[1]
    hint = " (check --json-keys)" if summary.problem_counts["missing_key"] else ""
    return (f"{where}: no documents for key {key!r}: every line was skipped{hint}; nothing was written:\n{report}")


def _check_and_collect(result: ChunkResult, line_base: int, summary: PreprocessSummary, strict: bool, path: str) -> None:
    if strict and result.problem_counts:
        kind, line, detail = min(result.problems, key=lambda p: p[1])
        raise PreprocessError(
            f"{path}:{line_base + line}: {PROBLEM_KINDS[kind]}" + (f": {detail}" if detail else "")
            + " (--strict stops at the first bad line; drop it to skip bad lines instead)"
        )
    summary.problem_counts.update(result.problem_counts)
    for kind, line, detail in sorted(result.problems, key=lambda p: p[1]):
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


def tokenizer_from_args(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None,
                        vocab_file: str | None = None, merge_file: str | None = None) -> Tokenizer:
    """build_tokenizer with its ValueError turned into the tool's error type."""
    try:
        return build_tokenizer(tokenizer_type, tokenizer_model, vocab_size, vocab_file=vocab_file,
                               merge_file=merge_file)
    except ValueError as exc:
        raise PreprocessError(str(exc)) from None
