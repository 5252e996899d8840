"""Tokenize a jsonl corpus into Megatron-compatible ``PREFIX_{key}_document.bin/.idx`` (Megatron-LM's flags).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --json-keys text \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2

Bad lines (malformed JSON, not UTF-8, missing key, empty document) are skipped and reported with their
line numbers; ``--strict`` stops at the first one instead. Nothing appears under the output names until
the run completes.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megafp8.data.indexed_dataset import IndexedDatasetError  # noqa: E402
from megafp8.data.preprocess import (  # noqa: E402
    PreprocessError,
    format_summary,
    preprocess,
    tokenizer_from_args,
)
from megafp8.data.tokenizer import TOKENIZER_TYPES  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (one dataset each)")
    group.add_argument("--strict", action="store_true", help="fail at the first bad line instead of skipping it")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", help="SentencePiece .model, or tokenizer.json / local HF directory")
    group.add_argument("--vocab-size", type=int, help="vocabulary size for NullTokenizer")
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: its vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: its merges.txt")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document id to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="cores to use: tokenizer threads (SentencePiece, HuggingFace tokenizers), else processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="split the input into this many byte ranges (see --partition-index)")
    group.add_argument("--partition-index", type=int, default=None,
                       help="process only this range of --partitions, e.g. one per job; merge the outputs "
                            "with tools/merge_datasets.py. Without it the whole input is processed")
    group.add_argument("--log-interval", type=int, default=10000, help="documents between progress reports")
    group.add_argument("--no-progress-bar", action="store_true", help="plain log lines instead of a bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # HuggingFace tokenizers encode batches on a Rayon pool sized once, from this variable, at first use.
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(args.workers, 1)))
    try:
        tokenizer = tokenizer_from_args(args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                                        vocab_file=args.vocab_file, merge_file=args.merge_file)
        summary = preprocess(
            args.input,
            args.output_prefix,
            tokenizer,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            strict=args.strict,
            partitions=args.partitions,
            partition_index=args.partition_index,
            log_interval=args.log_interval,
            progress=False if args.no_progress_bar else None,
        )
    except (PreprocessError, IndexedDatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. the disk filled up: the .tmp files were removed, nothing else was written
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no output was written under the final names", file=sys.stderr)
        return 130
    if summary.problem_counts:
        print(summary.report(args.input), file=sys.stderr)
    for key in args.json_keys:
        print(format_summary(summary, key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
