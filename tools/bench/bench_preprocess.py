"""Benchmark preprocessing throughput (ours vs a Megatron-LM-algorithm baseline) and GPT index building.

    python tools/bench/bench_preprocess.py --workdir /tmp/bench_data --output docs/bench_preprocess.json

1. Preprocessing: the embedded corpus tokenized with a SentencePiece BPE model trained on it, at 1 and 2
   workers; tokens/s and MB/s of input, best of ``--repeats``. Two inputs: ``files`` is the corpus as
   built (one document per stdlib source file, ~18 KB each: tokenizer-bound) and ``paragraphs`` its
   docstrings cut at blank lines (one short document per paragraph, ~120 bytes: overhead-bound). The baseline is Megatron-LM's
   ``tools/preprocess_data.py`` algorithm re-implemented here (we cannot download the script): a
   ``multiprocessing.Pool(workers).imap`` over the input's lines with chunksize 32, one ``json.loads`` and
   one ``encode_as_ids`` per line in the workers, and Megatron-Core's real ``IndexedDatasetBuilder`` (the
   ``megatron-core`` package) writing each document in the main process. It runs only when
   ``megatron.core`` imports. Both outputs are compared byte for byte.
2. Index building: document, sample and shuffle index of a GPT dataset over 10^8 and 10^9 tokens of
   synthetic document lengths (nothing is read from disk), with Megatron-Core's compiled
   ``build_sample_idx`` timed on the same document order when available.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megafp8.data.corpus import build_corpus  # noqa: E402
from megafp8.data.gpt_dataset import build_document_index, build_sample_index, build_shuffle_index  # noqa: E402
from megafp8.data.preprocess import preprocess  # noqa: E402
from megafp8.data.tokenizer import SentencePieceTokenizer  # noqa: E402
from megafp8.data.tokenizer_training import train_sentencepiece  # noqa: E402


def _megatron():
    """megatron.core's indexed_dataset and helpers modules, or None when the package is unavailable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers, indexed_dataset
        return indexed_dataset, helpers
    except Exception:  # ImportError, or a missing compiled helper
        return None


# --- Megatron-LM preprocess_data.py algorithm (baseline) -------------------------------------------------

class _MegatronStyleEncoder:
    """Per-worker state as in Megatron's Encoder: a tokenizer built once, then one call per json line."""

    def __init__(self, model_path: str, json_keys: list[str], append_eod: bool) -> None:
        self.model_path, self.json_keys, self.append_eod = model_path, json_keys, append_eod

    def initializer(self) -> None:
        import sentencepiece as spm

        _MegatronStyleEncoder.sp = spm.SentencePieceProcessor(model_file=self.model_path)

    def encode(self, json_line: str):
        data = json.loads(json_line)
        ids, lens = {}, {}
        for key in self.json_keys:
            doc_ids = _MegatronStyleEncoder.sp.encode_as_ids(data[key])
            lengths = [len(doc_ids)] if doc_ids else []
            if doc_ids and self.append_eod:
                doc_ids.append(_MegatronStyleEncoder.sp.eos_id())
                lengths[-1] += 1
            ids[key], lens[key] = doc_ids, lengths
        return ids, lens, len(json_line)


def megatron_style_preprocess(input_path: str, output_prefix: str, model_path: str, workers: int) -> tuple[float, int]:
    indexed_dataset, _ = _megatron()
    encoder = _MegatronStyleEncoder(model_path, ["text"], append_eod=True)
    vocab_size = SentencePieceTokenizer(model_path).vocab_size
    start = time.perf_counter()
    with open(input_path, encoding="utf-8") as fin:
        pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, fin, 32)
        builder = indexed_dataset.IndexedDatasetBuilder(
            output_prefix + "_text_document.bin", dtype=indexed_dataset.DType.optimal_dtype(vocab_size)
        )
        tokens = 0
        for doc, sentence_lens, _ in encoded:
            builder.add_document(doc["text"], sentence_lens["text"])
            tokens += len(doc["text"])
        builder.finalize(output_prefix + "_text_document.idx")
        pool.close()
        pool.join()
    return time.perf_counter() - start, tokens


# --- benchmarks ---------------------------------------------------------------------------------------------

def paragraph_corpus(workdir: str) -> str:
    """Short documents from real text: every paragraph of every stdlib docstring, one per line."""
    docstrings, path = os.path.join(workdir, "docstrings.jsonl"), os.path.join(workdir, "paragraphs.jsonl")
    build_corpus(docstrings, content="docstrings", progress=False)
    with open(docstrings, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        for line in f:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                if paragraph.strip():
                    out.write(json.dumps({"text": paragraph}, ensure_ascii=False) + "\n")
    return path


def bench_preprocess(corpus: str, model: str, workdir: str, repeats: int, name: str) -> list[dict]:
    size = os.path.getsize(corpus)
    rows = []
    have_megatron = _megatron() is not None
    for workers in (1, 2):
        ours, base = [], []
        # Alternate the two so that load from other processes on a shared machine hits both alike.
        for _ in range(repeats):
            summary = preprocess(corpus, os.path.join(workdir, f"ours_w{workers}"), SentencePieceTokenizer(model),
                                 append_eod=True, workers=workers, progress=False)
            ours.append(summary.seconds)
            if have_megatron:
                base.append(megatron_style_preprocess(corpus, os.path.join(workdir, f"megatron_w{workers}"),
                                                      model, workers)[0])
        tokens = summary.tokens["text"]
        row = {"input": name, "workers": workers, "input_mb": size / 1e6, "documents": summary.documents["text"],
               "tokens": tokens, "ours_s": min(ours),
               "ours_tokens_per_s": tokens / min(ours), "ours_mb_per_s": size / 1e6 / min(ours)}
        if have_megatron:
            row.update(megatron_s=min(base), megatron_tokens_per_s=tokens / min(base),
                       megatron_mb_per_s=size / 1e6 / min(base), speedup=min(base) / min(ours))
            for ext in (".bin", ".idx"):
                with open(os.path.join(workdir, f"ours_w{workers}_text_document{ext}"), "rb") as f, \
                        open(os.path.join(workdir, f"megatron_w{workers}_text_document{ext}"), "rb") as g:
                    row[f"identical{ext}"] = f.read() == g.read()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_index(total_tokens: int, mean_length: int, seq_length: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    num_docs = total_tokens // mean_length
    lengths = rng.integers(1, 2 * mean_length, size=num_docs).astype(np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    num_samples = (tokens - 1) // seq_length
    phases = {"document_index_s": [], "sample_index_s": [], "shuffle_index_s": []}
    for _ in range(repeats):
        gen = np.random.default_rng(1234)
        t0 = time.perf_counter()
        document_index = build_document_index(np.arange(num_docs), 1, gen)
        t1 = time.perf_counter()
        build_sample_index(lengths, document_index, seq_length, num_samples)
        t2 = time.perf_counter()
        build_shuffle_index(num_samples, gen)
        t3 = time.perf_counter()
        for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[name].append(seconds)
    row = {"tokens": tokens, "documents": num_docs, "seq_length": seq_length, "samples": num_samples}
    row.update({name: min(values) for name, values in phases.items()})
    row["ours_total_s"] = sum(row[name] for name in phases)
    megatron = _megatron()
    if megatron is not None:
        helpers = megatron[1]
        document_index = document_index.astype(np.int32)
        start = time.perf_counter()
        helpers.build_sample_idx(lengths, document_index, seq_length, 1, tokens, True, True)
        row["megatron_cpp_sample_index_s"] = time.perf_counter() - start
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/megafp8_bench_preprocess")
    parser.add_argument("--max-bytes", type=int, default=None, help="corpus size (default: the whole stdlib)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--skip-preprocess", action="store_true")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
               "python": platform.python_version(), "command": " ".join(sys.argv),
               # other processes on a shared machine slow the 2-worker runs most: record the load
               "loadavg_before": os.getloadavg()}
    if not args.skip_preprocess:
        corpus = os.path.join(args.workdir, "stdlib.jsonl")
        build_corpus(corpus, max_bytes=args.max_bytes, progress=False)
        model = train_sentencepiece([corpus], os.path.join(args.workdir, f"sp{args.vocab_size}"), args.vocab_size,
                                    max_sentences=300_000, progress=False)
        results["preprocess"] = bench_preprocess(corpus, model, args.workdir, args.repeats, "files")
        results["preprocess"] += bench_preprocess(paragraph_corpus(args.workdir), model, args.workdir,
                                                  args.repeats, "paragraphs")
    results["index"] = [
        bench_index(total, mean, args.seq_length, args.repeats)
        for total in (10**8, 10**9) for mean in (1000, 100)
    ]
    results["loadavg_after"] = os.getloadavg()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
