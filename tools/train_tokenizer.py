"""Train a SentencePiece BPE tokenizer from jsonl or plain-text files.

    python tools/train_tokenizer.py --input data/stdlib.jsonl --model-prefix data/tok --vocab-size 8000

Writes ``PREFIX.model`` (pass it to ``--tokenizer-model``) and ``PREFIX.vocab``. Byte fallback is on by
default, so any text encodes without ``<unk>``; ``</s>`` (id 2) is the end-of-document id.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megafp8.data.tokenizer_training import train_sentencepiece  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl/.json (by --json-key) or text files")
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--character-coverage", type=float, default=0.9999,
                        help="fraction of characters covered by pieces; the rest go through byte fallback")
    parser.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false",
                        help="map uncovered characters to <unk> instead of UTF-8 byte pieces")
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--json-key", default="text", help="key holding the text in jsonl input")
    parser.add_argument("--max-sentences", type=int, default=None,
                        help="train on a random sample of this many lines (bounds memory on big corpora)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the --max-sentences sample")
    parser.add_argument("--num-threads", type=int, default=None, help="trainer threads (default: all cores)")
    parser.add_argument("--verbose", action="store_true", help="show SentencePiece's own training log")
    args = parser.parse_args(argv)
    try:
        train_sentencepiece(
            args.input,
            args.model_prefix,
            args.vocab_size,
            character_coverage=args.character_coverage,
            byte_fallback=args.byte_fallback,
            model_type=args.model_type,
            json_key=args.json_key,
            max_sentences=args.max_sentences,
            num_threads=args.num_threads,
            seed=args.seed,
            verbose=args.verbose,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
