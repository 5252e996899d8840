"""Resumable micro-batch sampling: started at ``consumed_samples = k`` it yields samples k, k+1, ... exactly.

Each global batch covers ``micro_batch_size * data_parallel_size`` consecutive sample indices, and data
parallel rank ``r`` takes slice ``r`` of it (Megatron's MegatronPretrainingSampler). The datasets are
already shuffled by their shuffle index, so sequential order here is the randomized order, and a run
resumed from a checkpoint's consumed-samples count sees the same samples as one never interrupted.
"""
from __future__ import annotations

import signal
from typing import Iterator

import torch


class PretrainingSampler(torch.utils.data.Sampler):
    """Batch sampler: lists of ``micro_batch_size`` indices for one data-parallel rank."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} is outside the dataset's {total_samples} samples "
                "(was the checkpoint trained on a different data blend or --train-samples?)"
            )
        if micro_batch_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"--micro-batch-size {micro_batch_size} must be >= 1 and the data-parallel rank "
                f"{data_parallel_rank} in [0, {data_parallel_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def _global_micro_batch(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self._global_micro_batch)
        return full + (0 if self.drop_last or rest <= self.data_parallel_rank * self.micro_batch_size else 1)

    def __iter__(self) -> Iterator[list[int]]:
        step = self._global_micro_batch
        mine = slice(self.data_parallel_rank * self.micro_batch_size, (self.data_parallel_rank + 1) * self.micro_batch_size)
        for start in range(self.consumed_samples, self.total_samples, step):
            batch = list(range(start, min(start + step, self.total_samples)))
            if len(batch) < step and self.drop_last:
                return
            if batch[mine]:
                yield batch[mine]


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
    num_workers: int = 0,
    drop_last: bool = True,
) -> torch.utils.data.DataLoader:
    """A DataLoader of ``{"tokens": LongTensor[micro_batch_size, seq_length + 1]}`` resuming at ``consumed_samples``.

    ``num_workers`` > 0 reads in that many worker processes; batches still come in sampler order, so they are
    the same for every ``num_workers``."""
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, drop_last
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=_ignore_stop_signals if num_workers > 0 else None,
    )


def _ignore_stop_signals(_worker_id: int) -> None:
    # A scheduler's SIGTERM (or a terminal's SIGINT) reaches the whole process group, workers included. The
    # training process then finishes its step and saves, reading batches meanwhile; a worker that died of the
    # signal would fail that read ("DataLoader worker exited unexpectedly"). Workers end when the loader is
    # closed, or on their own once the training process is gone.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
