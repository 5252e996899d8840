"""The training stall of a checkpoint save, synchronous vs --async-save vs a local non-persistent save, at a few model
sizes (one process).

    python tools/bench/bench_async_save.py --hidden 256 512 1024 --layers 4 --repeats 3

For each size: a GPTModel with fp32 weights and two Adam-like moments (the optimizer state a save carries).
Synchronous: the seconds ``save_checkpoint`` holds the caller (DCP write, fsync, SHA-256, commit). Asynchronous:
the seconds ``AsyncCheckpointWriter.start`` holds it (the copy to host memory; pinned on GPUs), then the background
write's own time (waited for before the next repeat, as the next save would). Medians of --repeats, each into a
fresh directory under --dir (default: a temporary one). On CPU the "host copy" is a memcpy in RAM; on a GPU it is
a device-to-host copy, the number to measure there. Local: the seconds a --non-persistent-ckpt-type local save
holds the caller (the host copy, torch.save of this rank's tensors, fsync, SHA-256, rename; no collective).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megafp8.checkpoint import save_checkpoint, tensor_parallel_state
from megafp8.checkpoint.async_save import AsyncCheckpointWriter
from megafp8.checkpoint.local_checkpoint import save_local
from megafp8.checkpoint.save_load import checkpoint_state
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState


def _optimizer_state(model: GPTModel) -> dict:
    return {name: {key: tensor_parallel_state(torch.full_like(p, fill), p, 0, 1, model.config.vocab_size)
                   for key, fill in (("exp_avg", 0.5), ("exp_avg_sq", 0.25))}
            for name, p in model.named_parameters()}


def measure(hidden: int, layers: int, vocab: int, repeats: int, root: Path) -> dict:
    ps = ParallelState().init_process_groups()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = ModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                         num_attention_heads=max(1, hidden // 64), vocab_size=vocab, seq_length=128)
    model = GPTModel(config, ps).to(device)
    optimizer = _optimizer_state(model)
    params = sum(p.numel() for p in model.parameters())
    sync, held, written, local = [], [], [], []
    for r in range(repeats):
        start = time.perf_counter()
        save_checkpoint(root / f"sync{hidden}_{r}", 1, model=model, parallel_state=ps, optimizer_state=optimizer)
        sync.append(time.perf_counter() - start)
        writer = AsyncCheckpointWriter(None)
        times = []
        state = checkpoint_state(model, ps, optimizer)
        held.append(writer.start(state, root / f"async{hidden}_{r}", 1, parallel_state=ps,
                                 on_commit=lambda _path, seconds: times.append(seconds)))
        writer.wait()
        written.append(times[0])
        start = time.perf_counter()
        own = {"model": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
               "optimizer": {name: {key: torch.full_like(p, fill, device="cpu") for key, fill in
                                    (("exp_avg", 0.5), ("exp_avg_sq", 0.25))} for name, p in model.named_parameters()}}
        save_local(root / f"local{hidden}_{r}", 1, 0, own, {"rank": 0})
        local.append(time.perf_counter() - start)
    return dict(hidden=hidden, layers=layers, params=params, sync_s=statistics.median(sync),
                async_held_s=statistics.median(held), async_write_s=statistics.median(written),
                local_s=statistics.median(local))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}")
    print("| hidden | parameters | sync save stall (s) | async stall (s) | async stall / sync | background write (s) | "
          "local save (s) | local / sync |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for hidden in args.hidden:
            row = measure(hidden, args.layers, args.vocab, args.repeats, Path(tmp))
            print(f"| {hidden} | {row['params'] / 1e6:.1f} M | {row['sync_s']:.3f} | {row['async_held_s']:.3f} | "
                  f"{row['async_held_s'] / row['sync_s']:.3f} | {row['async_write_s']:.3f} | {row['local_s']:.3f} | "
                  f"{row['local_s'] / row['sync_s']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
