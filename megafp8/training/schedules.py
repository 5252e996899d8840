"""The learning-rate schedules of a run's flags: the main one and --decoupled-lr's."""
from __future__ import annotations

import argparse
import dataclasses

from megafp8.optim.lr_schedule import LearningRateSchedule


def learning_rate_schedule(args: argparse.Namespace) -> LearningRateSchedule:
    """--lr, --min-lr, --lr-decay-style and the warm-up/decay lengths (iterations or samples; or the warm-up as
    --lr-warmup-fraction of the decay length, Megatron's lr_warmup_steps = fraction x lr_decay_steps, unrounded)."""
    if args.lr_decay_samples is not None:
        decay = args.lr_decay_samples
    elif args.lr_decay_iters is not None:
        decay = args.lr_decay_iters * args.global_batch_size
    else:
        decay = args.train_samples
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction < 1:  # Megatron's scheduler asserts warm-up < decay
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
        warmup = args.lr_warmup_fraction * decay
    elif args.lr_warmup_samples is not None:
        warmup = args.lr_warmup_samples
    else:
        warmup = args.lr_warmup_iters * args.global_batch_size
    wsd = args.lr_wsd_decay_samples
    if wsd is None and args.lr_wsd_decay_iters is not None:
        wsd = args.lr_wsd_decay_iters * args.global_batch_size
    return LearningRateSchedule(max_lr=args.lr, min_lr=args.min_lr, warmup_samples=warmup, decay_samples=decay,
                                decay_style=args.lr_decay_style, wsd_decay_samples=wsd,
                                wsd_decay_style=args.lr_wsd_decay_style)


def decoupled_learning_rate_schedule(args: argparse.Namespace) -> LearningRateSchedule | None:
    """--decoupled-lr's schedule of the input embedding and the output layer (megafp8.training.run's
    DECOUPLED_LR_PARAMS), None without it: Megatron's param-group override, the same warm-up and decay from the same
    --lr-warmup-init, to --decoupled-min-lr, else --min-lr."""
    if args.decoupled_lr is None:
        return None
    min_lr = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
    return dataclasses.replace(learning_rate_schedule(args), max_lr=args.decoupled_lr, min_lr=min_lr)
