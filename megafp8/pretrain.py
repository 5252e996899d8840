"""Training entry point: `torchrun [...] -m megafp8.pretrain [flags]` (console script `megafp8-pretrain`).

Everything a user can get wrong (flags, the layout, the tokenizer, the data prefixes) is checked on
every rank before any process-group work, and reported once, by rank 0, with exit status 2.
`--fp8-self-check` alone runs the FP8 kernel self-check instead of training.
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from megafp8.data.builder import parse_data_path
from megafp8.parallel.parallel_state import LayoutError, initialize_distributed
from megafp8.training.arguments import ArgumentError, parse_args
from megafp8.training.data_setup import tokenizer_vocab_size
from megafp8.training.model_setup import model_config_from_args, parallel_state_from_args


def _fail(message: str) -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"megafp8-pretrain: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--fp8-self-check"]:
        from megafp8.training.self_check import print_self_check

        print_self_check()
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = parse_args(argv, world_size)
        parallel_state = parallel_state_from_args(args)
        config = model_config_from_args(args, tokenizer_vocab_size(args))
        parallel_state.validate_model(config, global_batch_size=args.global_batch_size,
                                      micro_batch_size=args.micro_batch_size)
        parse_data_path(args.data_path)  # every prefix exists
        if os.environ.get("MEGAFP8_FORCE_FP8_OVERFLOW"):  # a test hook (megafp8/fp8/forced_overflow.py)
            from megafp8.fp8.forced_overflow import check_forced_overflow

            check_forced_overflow(args.fp8_format, args.fp8_recipe)
    except (ArgumentError, LayoutError, ValueError, FileNotFoundError) as e:
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
