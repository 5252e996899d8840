"""From flags to this rank's data: the tokenizer, the train/valid datasets (--data-path or --mock-data) and
resumable batch iterators, read in the training process or by --num-workers data-loader processes."""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from megafp8.data.builder import build_train_valid_test_datasets, parse_data_path, samples_available
from megafp8.data.gpt_dataset import samples_in
from megafp8.data.indexed_dataset import IndexedDataset
from megafp8.data.mock_dataset import build_mock_datasets
from megafp8.data.sampler import build_pretraining_data_loader
from megafp8.data.splits import parse_split, split_ranges
from megafp8.data.tokenizer import Tokenizer, build_tokenizer
from megafp8.parallel.parallel_state import ParallelState


def _flag(args: argparse.Namespace, dest: str, default):
    # Megatron-LM's data flags (megafp8.training.megatron_flags); a Namespace built without them (tests, older
    # callers) means Megatron's defaults.
    return getattr(args, dest, default)


def tokenizer_from_args(args: argparse.Namespace) -> Tokenizer:
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                           vocab_file=_flag(args, "vocab_file", None), merge_file=_flag(args, "merge_file", None))


def tokenizer_vocab_size(args: argparse.Namespace) -> int:
    return tokenizer_from_args(args).vocab_size


def data_cache_dir(args: argparse.Namespace) -> str | None:
    """--data-cache-path: where every index cache goes (sample indices, blends, token-id ranges); None: beside
    each dataset (megafp8.data.builder.default_cache_dir), or nowhere for --mock-data, as in Megatron."""
    return _flag(args, "data_cache_path", None)


def num_validation_samples(args: argparse.Namespace) -> int:
    """Megatron's count: eval_iters global batches at every evaluation, plus one at the end."""
    train_iters = -(-args.train_samples // args.global_batch_size)
    return (train_iters // args.eval_interval + 1) * args.eval_iters * args.global_batch_size


def training_length_errors(args: argparse.Namespace) -> list[str]:
    """The training length checked against what --data-path gives, before any training (one line each).

    Only an unweighted list of prefixes can fall short (Megatron-Core gives one epoch of each member and
    no more): there a longer run would stop mid-way when the data ends, so it is refused up front."""
    if not args.data_path or not args.train_samples or min(args.seq_length or 0, args.global_batch_size or 0) <= 0:
        return []  # the flags' own checks report these
    try:
        available = samples_available(args.data_path, args.split, args.seq_length)[0]
    except ValueError as e:  # a bad --split (or --data-path, which input_errors reports too)
        return [str(e)]
    if available is None or args.train_samples <= available:
        return []
    return [_too_few_samples(args, available)]


def _split_tokens(args: argparse.Namespace) -> dict[str, list[int]]:
    """Per data prefix, the tokens its train / valid / test split of --split holds (reads each .idx only); empty
    when --split or --data-path is malformed (their own checks say so)."""
    try:
        _, prefixes = parse_data_path(args.data_path)
        weights = parse_split(args.split)
    except ValueError:
        return {}
    tokens = {}
    for prefix in prefixes:
        lengths = np.asarray(IndexedDataset(prefix).sequence_lengths)
        tokens[prefix] = [int(lengths[begin:end].sum(dtype=np.int64))
                          for begin, end in split_ranges(len(lengths), weights)]
    return tokens


def split_errors(args: argparse.Namespace) -> list[str]:
    """A prefix whose training split (or, with --eval-iters, a non-empty validation split) holds less than one
    sample of --seq-length + 1 tokens: found here, not once the model is built."""
    if not args.data_path or not args.seq_length or args.seq_length <= 0:
        return []
    errors = []
    for prefix, (train, valid, _) in _split_tokens(args).items():
        for name, tokens in (("training", train), ("validation", valid if args.eval_iters > 0 else 0)):
            if (name == "training" or tokens) and samples_in(tokens, args.seq_length) < 1:
                errors.append(f"--split {args.split}: the {name} split of --data-path {prefix} holds {tokens} tokens, "
                              f"less than one sample of --seq-length {args.seq_length} + 1; change --split or give "
                              "more data" + (" (or --eval-iters 0)" if name == "validation" else ""))
    return errors


def split_warnings(args: argparse.Namespace) -> list[str]:
    split_tokens = _split_tokens(args) if args.data_path and args.eval_iters > 0 else {}
    if split_tokens and not any(valid for _, valid, _ in split_tokens.values()):
        return [f"--eval-iters {args.eval_iters}: --split {args.split} leaves no validation documents, so no "
                "validation runs (pass --eval-iters 0 to say so)"]
    return []


def _too_few_samples(args: argparse.Namespace, available: int) -> str:
    if args.train_iters is not None:
        requested = (f"--train-iters {args.train_iters} x --global-batch-size {args.global_batch_size} = "
                     f"{args.train_samples} training samples")
        longest = f"--train-iters {available // args.global_batch_size}"
    else:
        requested, longest = f"--train-samples {args.train_samples}", f"--train-samples {available}"
    return (f"{requested} is more than the unweighted --data-path {' '.join(args.data_path)} gives: {available} "
            f"samples, one epoch of each prefix's training split of --split {args.split} (Megatron-Core's "
            f"unweighted blend); train at most {longest}, or give each prefix a weight "
            "(--data-path WEIGHT PREFIX ...) to repeat its epochs")


def build_datasets(args: argparse.Namespace):
    """(train, valid) of --data-path, or of Megatron's synthetic documents with --mock-data (split a third each
    whatever --split says, as Megatron's builder does in mock mode)."""
    valid_samples = num_validation_samples(args) if args.eval_iters > 0 else 0
    if _flag(args, "mock_data", False):
        tokenizer = tokenizer_from_args(args)
        train, valid, _ = build_mock_datasets(tokenizer.vocab_size, tokenizer.eod, args.seq_length, args.seed,
                                              train_samples=args.train_samples, valid_samples=valid_samples,
                                              test_samples=0, cache_dir=data_cache_dir(args))
        return train, valid
    train, valid, _ = build_train_valid_test_datasets(
        args.data_path, args.split, args.seq_length, args.seed, train_samples=args.train_samples,
        valid_samples=valid_samples, test_samples=0, cache_dir=data_cache_dir(args),
        mmap_bin_files=_flag(args, "mmap_bin_files", True))
    if train is None:
        raise ValueError(f"--split {args.split} leaves no training documents in --data-path {' '.join(args.data_path)}")
    if len(train) < args.train_samples:  # megafp8.pretrain refuses this before training; a backstop for other callers
        raise ValueError(_too_few_samples(args, len(train)))
    return train, valid


def batches(dataset, consumed_samples: int, args: argparse.Namespace, parallel_state: ParallelState,
            cycle: bool = False) -> Iterator[torch.Tensor]:
    """This DP rank's micro-batches of tokens ``[micro_batch, seq_length + 1]`` from ``consumed_samples`` on.
    Every CP rank of a DP rank reads the same samples (the data order is CP=1's); each keeps its chunks later.

    ``cycle``: start over when the dataset ends (validation re-reads its split, as Megatron's cyclic loader);
    ``consumed_samples`` then counts every sample read since the start (``consumed_valid_samples``, which
    may exceed the dataset), and the iterator stands where an uninterrupted one would after reading them.

    With --num-workers N > 0 the samples are read by N data-loader processes (pinned on CUDA), in the same
    order: the batches are the same as N = 0's. ``close_batches`` stops them."""
    dp = _DataRank(parallel_state.data_parallel_rank, parallel_state.dp_size)
    if cycle:
        step = args.micro_batch_size * dp.size
        per_pass = len(dataset) // step * step  # each pass reads the whole global micro-batches, from sample 0
        if per_pass == 0:
            raise ValueError(f"the validation split holds {len(dataset)} samples, fewer than one micro-batch "
                             f"on each data-parallel rank (--micro-batch-size {args.micro_batch_size} x {dp.size}); "
                             "give it more documents (--split) or set --eval-iters 0")
        consumed_samples %= per_pass
    return _batches(dataset, consumed_samples, args.micro_batch_size, dp, cycle, _flag(args, "num_workers", 0))


def close_batches(*sources: Iterator[torch.Tensor] | None) -> None:
    """End ``batches`` iterators now: their data-loader worker processes exit here, not at interpreter teardown
    (which a torchrun rank skips: megafp8.pretrain leaves with os._exit)."""
    for source in sources:
        if source is not None:
            source.close()


class _DataRank(NamedTuple):
    """Which share of each global batch a rank reads: pure data parallelism, CP ranks excluded."""
    rank: int
    size: int


def _batches(dataset, consumed_samples: int, micro_batch_size: int, dp, cycle: bool,
             num_workers: int) -> Iterator[torch.Tensor]:
    while True:
        loader = build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size,
                                               data_parallel_rank=dp.rank, data_parallel_size=dp.size,
                                               num_workers=num_workers)
        for batch in loader:
            yield batch["tokens"]
        if not cycle:
            return
        consumed_samples = 0
