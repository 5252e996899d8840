"""Print the text of training samples: those a flight record names (a suspicious step's), or given indices.

    python tools/show_samples.py RUN_DIR/flight_records/iter_0000005.json            # the first non-finite samples
    python tools/show_samples.py RUN_DIR/flight_records/iter_0000005.json --all      # the step's whole global batch
    python tools/show_samples.py RUN_DIR/flight_records/iter_0000005.json --index 37 38

The record carries the run's flags; the training split is rebuilt from them (the same data, split, seed and
length: the same sample order) and each sample's tokens are detokenized with the run's tokenizer.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def samples_of(record: dict, everything: bool) -> list[int]:
    if everything:
        start, end = record["samples"]["global_batch"]
        return list(range(start, end))
    where = record.get("first_nonfinite") or {}
    return list(where.get("samples", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", help="a flight record (--log-dir/flight_records/iter_NNNNNNN.json)")
    parser.add_argument("--all", action="store_true", help="every sample of the step's global batch")
    parser.add_argument("--index", type=int, nargs="+", help="these training-split indices instead")
    options = parser.parse_args(argv)
    try:
        record = json.loads(Path(options.record).read_text())
        run_args = argparse.Namespace(**record["run_args"])
    except (OSError, json.JSONDecodeError, KeyError) as e:
        print(f"show_samples: {options.record}: not a flight record ({e})", file=sys.stderr)
        return 2
    indices = options.index or samples_of(record, options.all)
    if not indices:
        print(f"show_samples: {options.record} names no sample (no non-finite row was found): use --all or --index",
              file=sys.stderr)
        return 2
    from megafp8.training.data_setup import build_datasets, tokenizer_from_args  # heavy: after the arguments

    train, _ = build_datasets(run_args)
    tokenizer = tokenizer_from_args(run_args)
    for index in indices:
        if not 0 <= index < len(train):
            print(f"show_samples: sample {index} is outside the training split's {len(train)} samples", file=sys.stderr)
            return 2
        tokens = train[index]["tokens"].tolist()
        print(f"=== sample {index} ({len(tokens)} tokens) ===")
        print(tokenizer.detokenize(tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
