"""From flags to this rank's data: the tokenizer's vocabulary, the train/valid datasets and resumable iterators."""
from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch

from megafp8.data.builder import build_train_valid_test_datasets
from megafp8.data.sampler import build_pretraining_data_loader
from megafp8.data.tokenizer import build_tokenizer
from megafp8.parallel.parallel_state import ParallelState


def tokenizer_vocab_size(args: argparse.Namespace) -> int:
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size).vocab_size


def num_validation_samples(args: argparse.Namespace) -> int:
    """Megatron's count: eval_iters global batches at every evaluation, plus one at the end."""
    train_iters = -(-args.train_samples // args.global_batch_size)
    return (train_iters // args.eval_interval + 1) * args.eval_iters * args.global_batch_size


def build_datasets(args: argparse.Namespace):
    train, valid, _ = build_train_valid_test_datasets(
        args.data_path, args.split, args.seq_length, args.seed, train_samples=args.train_samples,
        valid_samples=num_validation_samples(args) if args.eval_iters > 0 else 0, test_samples=0)
    if train is None:
        raise ValueError(f"--split {args.split} leaves no training documents in --data-path {' '.join(args.data_path)}")
    return train, valid


def batches(dataset, consumed_samples: int, args: argparse.Namespace, parallel_state: ParallelState,
            cycle: bool = False) -> Iterator[torch.Tensor]:
    """This DP rank's micro-batches of tokens ``[micro_batch, seq_length + 1]`` from ``consumed_samples`` on.

    ``cycle``: start over when the dataset ends (validation re-reads its split; Megatron does the same)."""
    dp = parallel_state.dp_group
    while True:
        loader = build_pretraining_data_loader(dataset, consumed_samples, args.micro_batch_size,
                                               data_parallel_rank=dp.rank, data_parallel_size=dp.size)
        for batch in loader:
            yield batch["tokens"]
        if not cycle:
            return
        consumed_samples = 0
