"""Training entry point: `torchrun [...] -m megafp8.pretrain [flags]` (console script `megafp8-pretrain`).

Everything a user can get wrong (flags, the layout, the tokenizer, the data prefixes) is checked on
every rank before any process-group work, and reported once, by rank 0, with exit status 2.
`--fp8-self-check` alone runs the FP8 kernel self-check instead of training.
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from megafp8.checkpoint.atomic import save_dir_error
from megafp8.data.builder import default_cache_dir, parse_data_path
from megafp8.data.indexed_dataset import IndexedDataset
from megafp8.data.token_range import token_range_error
from megafp8.parallel.parallel_state import LayoutError, initialize_distributed
from megafp8.training.arguments import parse_and_check
from megafp8.training.data_setup import (
    data_cache_dir,
    split_errors,
    split_warnings,
    tokenizer_from_args,
    training_length_errors,
)
from megafp8.training.model_setup import model_config_from_args, parallel_state_from_args


def _is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _fail(message: str) -> int:
    if _is_rank_0():
        print(f"megafp8-pretrain: error: {message}", file=sys.stderr, flush=True)
    return 2


def input_errors(args) -> tuple[int | None, list[str]]:
    """(the tokenizer's vocabulary size, every problem with the tokenizer, the data prefixes and their indexes,
    the test hook); cheap: each index is opened and checked, and each .bin's token id range is read once (then
    cached with the index arrays: --data-cache-path, else beside the data). --mock-data has no data to check, but
    its documents are cut from the tokenizer's vocabulary and end-of-document id: it needs a whole tokenizer."""
    errors: list[str] = []
    vocab_size = None
    mock_data = getattr(args, "mock_data", False)
    if _tokenizer_given(args):
        try:
            tokenizer = tokenizer_from_args(args)
            vocab_size = tokenizer.vocab_size
            if mock_data and tokenizer.eod is None:
                errors.append(f"--mock-data: --tokenizer-type {args.tokenizer_type} has no end-of-document id "
                              "to end the synthetic documents with")
        except (ValueError, OSError, RuntimeError) as e:
            errors.append(str(e))
    elif mock_data and args.tokenizer_type not in _PARSER_CHECKED:  # no --tokenizer-model: no vocabulary to cut from
        errors.append(f"--mock-data: --tokenizer-type {args.tokenizer_type} needs --tokenizer-model (the synthetic "
                      "documents take its vocabulary size and end-of-document id), or use --tokenizer-type "
                      "NullTokenizer --vocab-size N")
    if args.data_path:
        first_data_error = len(errors)
        try:
            _, prefixes = parse_data_path(args.data_path)  # every prefix exists
        except ValueError as e:
            errors.append(str(e))
            prefixes = []
        for prefix in prefixes:
            try:
                dataset = IndexedDataset(prefix)  # a truncated or corrupt .idx/.bin: one line here, not a traceback
            except ValueError as e:
                errors.append(f"--data-path {prefix}: {e}")
                continue
            if dataset.dtype.kind == "f":  # a valid Megatron dataset, but not of token ids: they would be truncated
                errors.append(f"--data-path {prefix}: holds {dataset.dtype.name} values, not token ids (integers)")
                continue
            if vocab_size is not None:  # ids past the vocabulary would train silently (masked or padding rows)
                error = token_range_error(prefix, vocab_size, data_cache_dir(args) or default_cache_dir(prefix))
                if error:
                    errors.append(error)
        if prefixes and len(errors) == first_data_error:  # the data opens: does it last --train-iters/-samples?
            errors += split_errors(args) or training_length_errors(args)
    if args.save is not None:
        error = save_dir_error(args.save)
        if error:
            errors.append(error)
    if os.environ.get("MEGAFP8_FORCE_OUTLIER"):  # a test hook (megafp8/fp8/forced_outlier.py)
        from megafp8.fp8.forced_outlier import ForcedOutlier

        try:
            ForcedOutlier.from_env()
        except ValueError as e:
            errors.append(str(e))
        if args.fp8_format is None:
            errors.append("MEGAFP8_FORCE_OUTLIER grows an FP8 layer's input outliers: it needs --fp8-format")
    if os.environ.get("MEGAFP8_FORCE_FP8_OVERFLOW"):  # a test hook (megafp8/fp8/forced_overflow.py)
        from megafp8.fp8.forced_overflow import check_forced_overflow

        try:
            check_forced_overflow(args.fp8_format, args.fp8_recipe)
        except ValueError as e:
            errors.append(str(e))
    return vocab_size, errors


# Tokenizer types whose missing flags the parser reports whatever the data (--vocab-size; --vocab-file and
# --merge-file); the others need --tokenizer-model, which it asks for with --data-path only.
_PARSER_CHECKED = ("NullTokenizer", "GPT2BPETokenizer")


def _tokenizer_given(args) -> bool:
    """Whether the flags name a whole tokenizer (a missing part is the parser's message, not a failed load)."""
    if args.tokenizer_type == "NullTokenizer":
        return args.vocab_size is not None
    if args.tokenizer_type == "GPT2BPETokenizer":
        return getattr(args, "vocab_file", None) is not None and getattr(args, "merge_file", None) is not None
    return args.tokenizer_model is not None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--fp8-self-check"]:
        from megafp8.training.self_check import print_self_check

        return 0 if print_self_check() else 1
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args, errors, warnings = parse_and_check(argv, world_size)  # argparse itself exits 2 on an unknown flag
    vocab_size, more_errors = input_errors(args)
    errors += more_errors
    if errors:
        return _fail("invalid arguments:\n" + "\n".join(f"  - {e}" for e in errors))
    warnings += split_warnings(args)  # the data opened: an empty validation split is worth a word
    if _is_rank_0():
        for message in warnings:
            print(f"megafp8-pretrain: warning: {message}", file=sys.stderr, flush=True)
    try:
        parallel_state = parallel_state_from_args(args)
        config = model_config_from_args(args, vocab_size)
        parallel_state.validate_model(config, global_batch_size=args.global_batch_size,
                                      micro_batch_size=args.micro_batch_size)
    except (LayoutError, ValueError) as e:  # the flags' checks cover these; kept as a backstop
        return _fail(str(e))

    from megafp8.training.run import run  # heavy imports only once the flags are known to be good

    if "WORLD_SIZE" not in os.environ:  # a plain `python -m` run is one process: no process group needed
        return run(args, parallel_state, config)
    initialize_distributed(timeout_minutes=args.distributed_timeout_minutes)
    status = run(args, parallel_state, config)  # an exception propagates: torchrun then stops the other ranks
    # Tear the groups down together, then leave at once: interpreter teardown can still abort (SIGABRT,
    # "terminate called without an active exception") on threads gloo left behind, failing a finished job.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
