"""Model-state bytes per parameter (weights + grads + master + optimizer state held by one rank / parameters
of that rank's model), measured by DistributedOptimizer.model_state_bytes_per_param() from the real tensors
of a real gloo run at each DP size, for Megatron-style BF16 mixed precision and megafp8's presets.

    python tools/bench/bench_model_state.py [--dp-sizes 1 8] [--num-layers 8 --hidden-size 512 ...]

Prints a markdown table (one row per preset, one column per DP size: rank 0's value and the max over ranks).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile

import torch
import torch.distributed as dist

PRESETS = {
    # name: (recipe of the FP8/FP4 layers or None, DDP flags, optimizer flags)
    "Megatron BF16 (bf16 weights, fp32 grads, fp32 master + Adam)":
        (None, dict(), dict(master_weight_dtype="fp32", optimizer_state_dtype="fp32")),
    "megafp8 fp8-params (FP8 weight gather, fp32 grads, fp32 master + Adam)":
        ("delayed", dict(fp8_param_gather=True), dict(master_weight_dtype="fp32", optimizer_state_dtype="fp32")),
    "megafp8 bf16-states (FP8 weights, bf16 grads, fp32 master, bf16 Adam)":
        ("delayed", dict(fp8_param_gather=True, grad_reduce_in_bf16=True),
         dict(master_weight_dtype="fp32", optimizer_state_dtype="bf16")),
    "megafp8 fp8-states (FP8 weights, bf16 grads, fp16 master, FP8 Adam)":
        ("delayed", dict(fp8_param_gather=True, grad_reduce_in_bf16=True),
         dict(master_weight_dtype="fp16", optimizer_state_dtype="fp8")),
    "megafp8 fp4-params (--fp4-param-gather: NVFP4 weights, bf16 grads, fp16 master, FP8 Adam)":
        ("nvfp4", dict(fp8_param_gather=True, grad_reduce_in_bf16=True),
         dict(master_weight_dtype="fp16", optimizer_state_dtype="fp8")),
}


def _measure(rank: int, world_size: int, init_file: str, model_kw: dict, queue) -> None:
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    from megafp8.fp8 import Fp8Recipe
    from megafp8.model import GPTModel, ModelConfig
    from megafp8.optim import DistributedOptimizer
    from megafp8.parallel.data_parallel import DDPConfig, DistributedDataParallel
    from megafp8.parallel.parallel_state import ParallelState

    ps = ParallelState(world_size=world_size).init_process_groups()
    cfg = ModelConfig(params_dtype=torch.bfloat16, **model_kw)
    results = {}
    for name, (scaling, ddp_kw, opt_kw) in PRESETS.items():
        torch.manual_seed(0)
        recipe = Fp8Recipe.named(scaling, fp8_format="e4m3") if scaling else None
        model = GPTModel(cfg, ps, fp8_recipe=recipe)
        fp8_share = sum(m.weight.numel() for m in model.modules() if hasattr(m, "fp8_weight_quantization")
                        and getattr(m, "weight", None) is not None and not m.runs_high_precision)
        fp8_share /= sum(p.numel() for p in model.parameters())
        ddp = DistributedDataParallel(model, ps, DDPConfig(use_distributed_optimizer=True, fp8_recipe=recipe, **ddp_kw))
        opt = DistributedOptimizer(ddp, **opt_kw)
        results[name] = (opt.model_state_bytes_per_param(), fp8_share)
        del model, ddp, opt
    queue.put((rank, results))
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(world_size: int, model_kw: dict) -> dict[str, tuple[float, float, float]]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_measure, args=(r, world_size, os.path.join(tmp, "rdv"), model_kw, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        per_rank = dict(queue.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    return {name: (per_rank[0][name][0], max(r[name][0] for r in per_rank.values()), per_rank[0][name][1])
            for name in PRESETS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--ffn-hidden-size", type=int, default=1408)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args(argv)
    model_kw = dict(num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                    num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size, seq_length=64)
    columns = {dp: measure(dp, model_kw) for dp in args.dp_sizes}
    share = next(iter(columns.values()))[list(PRESETS)[-2]][2]
    print(f"model: {model_kw}; FP8-eligible parameter share f = {share:.3f}\n")
    print("| preset | " + " | ".join(f"DP={dp} (rank 0 / max)" for dp in args.dp_sizes) + " |")
    print("|---|" + "---|" * len(args.dp_sizes))
    for name in PRESETS:
        print(f"| {name} | " + " | ".join(f"{columns[dp][name][0]:.3f} / {columns[dp][name][1]:.3f}"
                                         for dp in args.dp_sizes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
