"""Build the embedded jsonl corpus from the Python standard library's sources: no download needed.

    python tools/build_corpus.py --output data/stdlib.jsonl --max-bytes 4000000

One document per ``.py`` file, ``{"text": ..., "path": ...}``, in sorted path order (deterministic for a
given Python build). ``--content docstrings`` keeps only module/class/function docstrings (prose).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megafp8.data.corpus import CONTENT_KINDS, build_corpus, stdlib_root  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="jsonl file to write")
    parser.add_argument("--content", choices=CONTENT_KINDS, default="source", help="whole files or docstrings only")
    parser.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    parser.add_argument("--max-bytes", type=int, default=None, help="stop once this many bytes of text are written")
    parser.add_argument("--root", default=None, help=f"directory to walk (default: the stdlib, {stdlib_root()})")
    args = parser.parse_args(argv)
    try:
        stats = build_corpus(args.output, args.content, args.max_docs, args.max_bytes, args.root)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.output}: {stats.documents} documents, {stats.bytes:,} bytes of text "
        f"(skipped {stats.skipped_undecodable} undecodable and {stats.skipped_empty} empty files)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
