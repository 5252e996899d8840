"""Concatenate indexed datasets (e.g. written by several preprocessing jobs) into one ``.bin/.idx`` pair.

    python tools/merge_datasets.py --input data/parts --output-prefix data/corpus_text_document
    python tools/merge_datasets.py --input data/p0_text_document data/p1_text_document --output-prefix OUT

``--input`` is either one directory (every ``*.idx`` prefix in it, in natural sort order, so ``p2`` comes
before ``p10``) or the prefixes themselves, in the order given. All inputs must share a token dtype.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megafp8.data.indexed_dataset import IndexedDatasetError, merge_indexed_datasets  # noqa: E402
from megafp8.data.preprocess import PreprocessError, check_output_prefix  # noqa: E402


def input_prefixes(inputs: list[str]) -> list[str]:
    """Expand a directory into its dataset prefixes; pass prefixes through (a trailing .bin/.idx is dropped)."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        directory = inputs[0]
        names = sorted((n[: -len(".idx")] for n in os.listdir(directory) if n.endswith(".idx")), key=_natural_key)
        if not names:
            raise IndexedDatasetError(f"--input {directory}: no .idx files in this directory")
        return [os.path.join(directory, n) for n in names]
    prefixes = []
    for given in inputs:
        prefix = given[: -len(".idx")] if given.endswith((".idx", ".bin")) else given
        if not (os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin")):
            raise IndexedDatasetError(
                f"--input {given}: no such directory, and no dataset {prefix}.idx/.bin (give one directory of "
                "datasets, or dataset prefixes such as data/parts/part0_text_document)"
            )
        prefixes.append(prefix)
    return prefixes


def _natural_key(name: str) -> list:
    # Jobs name their outputs part0 .. part11: a plain sort would put part10 before part2.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="a directory, or dataset prefixes in order")
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    args = parser.parse_args(argv)
    try:
        check_output_prefix(args.output_prefix)
        prefixes = input_prefixes(args.input)
        if os.path.abspath(args.output_prefix) in {os.path.abspath(p) for p in prefixes}:
            raise IndexedDatasetError(f"--output-prefix {args.output_prefix}: is also an input")
        merged = merge_indexed_datasets(prefixes, args.output_prefix)
    except (IndexedDatasetError, PreprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx: "
        f"{merged.num_documents:,} documents, {merged.num_tokens:,} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
