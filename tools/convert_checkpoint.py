"""Convert checkpoints: HF Llama <-> megafp8, Megatron-LM <-> megafp8, megafp8 -> block-FP8 HF (docs/conversion.md)."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megafp8.checkpoint.atomic import save_dir_error  # noqa: E402
from megafp8.checkpoint.errors import CheckpointError  # noqa: E402

SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    """'5GB', '200MiB', '1000' -> bytes; anything else (abc, nanGB, 0) is a CheckpointError naming the flag."""
    upper = text.strip().upper()
    number, factor = upper, 1
    for unit, unit_factor in sorted(SIZE_UNITS.items(), key=lambda kv: -len(kv[0])):
        if upper.endswith(unit):
            number, factor = upper[: -len(unit)], unit_factor
            break
    try:
        size = float(number) * factor
    except ValueError:
        size = float("nan")
    if not math.isfinite(size) or size < 1:
        raise CheckpointError(f"--max-shard-size {text}: expected a positive size like 5GB, 200MiB or 1000000")
    return int(size)


def check_load_dir(load_dir: str, load_format: str, iteration: int | None) -> None:
    """--load-dir must be a directory holding what --load-format reads first; else one line naming it."""
    path = Path(load_dir)
    if not path.exists():
        raise CheckpointError(f"--load-dir {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"--load-dir {path} is not a directory (--load-format {load_format} reads a "
                              "checkpoint directory)")
    if load_format == "hf":
        if not (path / "config.json").is_file():
            raise CheckpointError(f"--load-dir {path} has no config.json: not a Hugging Face model directory")
        if not any(path.glob("*.safetensors")):
            raise CheckpointError(f"--load-dir {path} has no *.safetensors files (PyTorch .bin checkpoints: "
                                  "re-save them with save_pretrained(safe_serialization=True))")
        return
    kind = "megafp8" if load_format == "megafp8" else "Megatron-LM"
    if iteration is None:
        if not (path / "latest_checkpointed_iteration.txt").is_file():
            raise CheckpointError(f"--load-dir {path} has no latest_checkpointed_iteration.txt: not a {kind} "
                                  "checkpoint directory (or pass --load-iteration)")
    elif not (path / f"iter_{iteration:07d}").is_dir():
        saved = sorted(p.name for p in path.glob("iter_*") if p.is_dir() and p.name[5:].isdigit())
        raise CheckpointError(f"--load-iteration {iteration}: --load-dir {path} has no iter_{iteration:07d} "
                              f"(it has {', '.join(saved) or 'no iter_* directories'})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--load-format", required=True, choices=["hf", "megafp8", "megatron"])
    p.add_argument("--save-format", required=True, choices=["megafp8", "hf", "hf-fp8", "hf-nvfp4", "hf-mxfp8", "megatron"])
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True, help="must not exist (or be empty); written atomically")
    p.add_argument("--load-iteration", type=int, default=None, help="megafp8/megatron: default the tracker's")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1,
                   help="->megafp8: checked to divide the model (the checkpoint reshards on load at any TP); "
                   "megafp8->megatron: the TP of the rank files written")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="as above, for PP")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="megafp8->megatron: pad the vocab to a multiple of this x TP (Megatron-LM's flag; default the "
                   "run's saved value, else 128); the Megatron-LM run must pass the same")
    p.add_argument("--apply-layernorm-1p", action="store_true",
                   help="hf->megafp8: store the RMSNorm gains zero-centred (g - 1), for runs with Megatron-LM's "
                   "--apply-layernorm-1p (megafp8->hf writes 1 + w back from the saved flag)")
    p.add_argument("--save-dtype", choices=["bf16", "fp32"], default="bf16", help="megafp8->hf")
    p.add_argument("--max-shard-size", default="5GB", help="megafp8->hf: start a new safetensors file past this")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megafp8.checkpoint.convert_hf import hf_to_megafp8, megafp8_to_hf, training_flags  # noqa: PLC0415
    from megafp8.checkpoint.hf_files import use_mmap_for_large_allocations  # noqa: PLC0415
    use_mmap_for_large_allocations()  # peak memory: about one tensor, independent of the model's size
    try:
        max_shard_bytes = parse_size(args.max_shard_size)
        check_load_dir(args.load_dir, args.load_format, args.load_iteration)
        if args.apply_layernorm_1p and (args.load_format, args.save_format) != ("hf", "megafp8"):
            raise CheckpointError("--apply-layernorm-1p applies to --load-format hf --save-format megafp8 only (the "
                                  "other directions read it from the checkpoint's saved flags)")
        problem = save_dir_error(args.save_dir, "--save-dir")  # before the conversion's work, not after it
        if problem:
            raise CheckpointError(problem)
        if args.load_format == "hf" and args.save_format == "megafp8":
            config = hf_to_megafp8(args.load_dir, args.save_dir, target_tp=args.target_tensor_parallel_size,
                                   target_pp=args.target_pipeline_parallel_size,
                                   zero_centered_gamma=args.apply_layernorm_1p, progress=not args.no_progress)
            print(f"wrote {args.save_dir} (iteration 0). Train from it with:\n  python -m megafp8.pretrain "
                  f"--load {args.save_dir} --finetune {training_flags(config)} --tokenizer-... (vocab "
                  f"{config.vocab_size})")
        elif args.load_format == "megafp8" and args.save_format in ("hf", "hf-fp8", "hf-nvfp4", "hf-mxfp8"):
            megafp8_to_hf(args.load_dir, args.save_dir, save_format=args.save_format, save_dtype=args.save_dtype,
                          max_shard_bytes=max_shard_bytes, iteration=args.load_iteration,
                          progress=not args.no_progress)
            print(f"wrote {args.save_dir}")
        elif args.load_format == "megatron" and args.save_format == "megafp8":
            from megafp8.checkpoint.convert_megatron import megatron_to_megafp8  # noqa: PLC0415
            config = megatron_to_megafp8(args.load_dir, args.save_dir, iteration=args.load_iteration,
                                         target_tp=args.target_tensor_parallel_size,
                                         target_pp=args.target_pipeline_parallel_size, progress=not args.no_progress)
            print(f"wrote {args.save_dir} (iteration 0). Train from it with --load {args.save_dir} --finetune "
                  f"{training_flags(config)} (vocab {config.vocab_size})")
        elif args.load_format == "megafp8" and args.save_format == "megatron":
            from megafp8.checkpoint.export_megatron import finetune_flags, megafp8_to_megatron  # noqa: PLC0415
            saved = megafp8_to_megatron(args.load_dir, args.save_dir, target_tp=args.target_tensor_parallel_size,
                                        target_pp=args.target_pipeline_parallel_size,
                                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                        iteration=args.load_iteration, progress=not args.no_progress)
            print(f"wrote {args.save_dir} (iteration {saved.iteration}, padded vocab {saved.padded_vocab_size}). "
                  f"Train from it in Megatron-LM with:\n  pretrain_gpt.py --load {args.save_dir} --finetune "
                  f"{finetune_flags(saved)} --tokenizer-... (vocab {saved.vocab_size})")
        else:
            raise CheckpointError(f"--load-format {args.load_format} --save-format {args.save_format} is not a "
                                  "supported pair: hf->megafp8, megatron->megafp8, megafp8->hf, megafp8->hf-fp8, "
                                  "megafp8->hf-nvfp4, megafp8->hf-mxfp8, megafp8->megatron")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
