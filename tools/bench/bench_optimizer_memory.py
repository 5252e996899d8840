"""Peak bytes of the temporaries one DistributedOptimizer.step() allocates beyond the persistent state (whole step,
and the FP8 publication inside it), absolute and per element of what the step takes at once (a bucket shard, or a
storage slab across buckets), for the fp32 and compressed presets with and without --fp8-param-gather, one CPU
process; with --transients, those of the master's start-up encode and of a checkpoint's state collection instead.

    python tools/bench/bench_optimizer_memory.py [--quick] [--num-layers 2 --hidden-size 512 ...]
    python tools/bench/bench_optimizer_memory.py --transients [...]   # start-up encode and checkpoint collection

Live bytes are tracked by a TorchDispatchMode: every storage an op allocates counts from its creation until the
last tensor the mode saw on it is freed (weakref finalizers); views and in-place results add nothing. Allocations
inside one aten kernel (its own scratch) are not seen.
"""
from __future__ import annotations

import argparse
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PRESETS = {"fp32": dict(master_weight_dtype="fp32", optimizer_state_dtype="fp32"),
           "compressed": dict(master_weight_dtype="fp16", optimizer_state_dtype="fp8")}
GATHER = ("off", "delayed", "blockwise")  # --fp8-param-gather with that FP8 recipe, or without


class LiveBytes(TorchDispatchMode):
    """Peak of the bytes held by storages that ops allocated inside the mode (on ``device_type`` only, if given)."""

    def __init__(self, device_type: str | None = None):
        super().__init__()
        self.live, self.peak = 0, 0
        self.device_type = device_type
        self._refs: dict[int, list[int]] = {}  # storage address -> [tensors alive on it, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or self.device_type not in (None, t.device.type):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._refs:  # a view (or in-place result) of a storage allocated in the mode
                self._refs[key][0] += 1
            elif key in inputs or storage.nbytes() == 0:  # persistent state, viewed or written in place
                continue
            else:
                self._refs[key] = [1, storage.nbytes()]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]


def measure(model_kw: dict, preset: str, gather: str) -> dict:
    sys.path.insert(0, "tests")
    from optim_testing import train_step
    from megafp8.fp8 import Fp8Recipe
    from megafp8.model import GPTModel, ModelConfig
    from megafp8.optim import DistributedOptimizer
    from megafp8.parallel.data_parallel import DDPConfig, DistributedDataParallel
    from megafp8.parallel.fp8_sequence_parallel import fp8_scaling_manager
    from megafp8.parallel.parallel_state import ParallelState

    torch.manual_seed(0)
    ps = ParallelState().init_process_groups()
    cfg = ModelConfig(**model_kw)
    recipe = None if gather == "off" else {"delayed": Fp8Recipe.delayed(), "blockwise": Fp8Recipe.blockwise()}[gather]
    model = GPTModel(cfg, ps, fp8_recipe=recipe)
    ddp = DistributedDataParallel(model, ps, DDPConfig(use_distributed_optimizer=True, fp8_param_gather=recipe is not None))
    opt = DistributedOptimizer(ddp, weight_decay=0.1, clip_grad=1.0, **PRESETS[preset])
    manager = fp8_scaling_manager(model, ps)
    for step in range(2):  # warm: delayed states warm, the publication's tables built
        train_step(ddp, opt, cfg, step, 1e-3, before_step=manager.update)
    step_mode, publish_mode = LiveBytes(), LiveBytes()
    step, publication = opt.step, getattr(opt, "_fp8_publication", None)

    def tracked_step(lr):
        with step_mode:
            return step(lr)

    if publication is not None:
        publish = publication.publish

        def tracked_publish():
            with publish_mode:
                publish()
        publication.publish = tracked_publish
    opt.step = tracked_step
    train_step(ddp, opt, cfg, 2, 1e-3, before_step=manager.update)
    shard = max(hi - lo for _b, lo, hi, _s in opt._shards)
    # What the step takes at once: a bucket shard (per-bucket step) or a storage slab (across buckets).
    unit = max((slab.n for slab in getattr(opt, "_slabs", [])), default=shard)
    fp8_unit = max((sum(slab.sizes) for slab in publication.slabs), default=0) if publication is not None else 0
    return dict(shard=shard, unit=unit, step=step_mode.peak, fp8_unit=fp8_unit,
                publish=publish_mode.peak if publication is not None else None, left=step_mode.live)


def measure_transients(model_kw: dict, preset: str, chunk_size: int = 1 << 16) -> dict:
    """Peak temporaries on the optimizer's device (a CPU here) of the start-up encode of the master (``_init_master``,
    from bf16 parameters as under --bf16) and of a checkpoint's state collection (``state_dict``,
    ``owned_master_weights``). Those two write their copies to the meta device, standing in for the host: every byte
    the mode then sees on the CPU is a temporary of the collection."""
    from megafp8.model import GPTModel, ModelConfig
    from megafp8.optim import DistributedOptimizer
    from megafp8.parallel.data_parallel import DDPConfig, DistributedDataParallel
    from megafp8.parallel.parallel_state import ParallelState

    torch.manual_seed(0)
    ps = ParallelState().init_process_groups()
    model = GPTModel(ModelConfig(**model_kw, params_dtype=torch.bfloat16), ps)
    ddp = DistributedDataParallel(model, ps, DDPConfig(use_distributed_optimizer=True))
    opt = DistributedOptimizer(ddp, chunk_size=chunk_size, **PRESETS[preset])
    peaks = {}
    for name, collect in (("init", opt._init_master), ("state_dict", lambda: opt.state_dict(device="meta")),
                          ("owned_master", lambda: opt.owned_master_weights(device="meta"))):
        mode = LiveBytes(device_type="cpu")
        with torch.no_grad(), mode:
            result = collect()
        del result
        peaks[name] = mode.peak
    return dict(numel=opt.master.numel, largest_fragment=max(f.numel for f in opt.fragments), chunk=opt.chunk_size,
                **peaks)


def print_transients(model_kw: dict) -> None:
    print("Peak bytes of temporaries on the optimizer's device:\n")
    print("| preset | shard elements | largest fragment | chunk | start-up encode | state_dict | owned_master_weights |")
    print("|---|---|---|---|---|---|---|")
    for preset in PRESETS:
        r = measure_transients(model_kw, preset)
        print(f"| {preset} | {r['numel']:,} | {r['largest_fragment']:,} | {r['chunk']:,} | {r['init']:,} | "
              f"{r['state_dict']:,} | {r['owned_master']:,} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model (seconds)")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--transients", action="store_true",
                        help="the start-up encode's and a checkpoint collection's temporaries instead of the step's")
    args = parser.parse_args(argv)
    hidden = 64 if args.quick else args.hidden_size
    model_kw = dict(num_layers=args.num_layers, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=4,
                    seq_length=16, vocab_size=256 if args.quick else args.vocab_size)
    print(f"model: {model_kw}\n")
    if args.transients:
        print_transients(model_kw)
        return 0
    print("| preset | --fp8-param-gather | largest bucket shard | elements the step takes at once | step peak "
          "temporaries: MiB, B/element taken | FP8 publication: elements at once, MiB, B/element |")
    print("|---|---|---|---|---|---|")
    for preset in PRESETS:
        for gather in GATHER:
            r = measure(model_kw, preset, gather)
            publish = "-" if not r["publish"] else \
                f"{r['fp8_unit']:,}, {r['publish'] / 2**20:.1f}, {r['publish'] / r['fp8_unit']:.1f}"
            print(f"| {preset} | {gather} | {r['shard']:,} | {r['unit']:,} | {r['step'] / 2**20:.1f}, "
                  f"{r['step'] / r['unit']:.1f} | {publish} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
