"""Peak memory and time of checkpoint conversion (tools/convert_checkpoint.py's functions), each direction in
a fresh process: peak RSS (ru_maxrss) above the same process's RSS after imports (VmRSS), against the size of the
model and of its largest single tensor, so "streams tensor by tensor" is a measured claim.

    python tools/bench/bench_convert.py                     # 8 layers, hidden 1024, vocab 8192: ~118M params
    python tools/bench/bench_convert.py --layers 16         # the model doubles, the peak should not

The HF source directory is written with random bf16 tensors, one safetensors file per layer.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megafp8.checkpoint.convert_hf import hf_shapes  # noqa: E402
from megafp8.checkpoint.hf_files import model_config_from_hf_dict  # noqa: E402

CHILD = """
import json, resource, sys, time
from megafp8.checkpoint.convert_hf import hf_to_megafp8, megafp8_to_hf
from megafp8.checkpoint.hf_files import use_mmap_for_large_allocations
use_mmap_for_large_allocations()  # as tools/convert_checkpoint.py does
# the RSS now (not ru_maxrss: the import phase's own high-water mark would hide the conversion's peak)
base = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1])
start = time.perf_counter()
kind, src, dst = sys.argv[1:4]
if kind == "hf->megafp8":
    hf_to_megafp8(src, dst, progress=False)
else:
    megafp8_to_hf(src, dst, save_format=kind.split("->")[1], save_dtype="bf16", progress=False)
print(json.dumps({"seconds": time.perf_counter() - start, "base_kib": base,
                  "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def write_hf_source(directory: Path, layers: int, hidden: int, ffn: int, heads: int, groups: int, vocab: int) -> dict:
    from safetensors.torch import save_file

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": groups, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    shapes = hf_shapes(model_config_from_hf_dict(config, "bench"))
    groups_by_file: dict[str, list[str]] = {}
    for name in shapes:
        key = name.split(".")[2] if name.startswith("model.layers.") else "other"
        groups_by_file.setdefault(key, []).append(name)
    weight_map = {}
    for i, (key, names) in enumerate(groups_by_file.items()):
        file = f"model-{i + 1:05d}-of-{len(groups_by_file):05d}.safetensors"
        save_file({n: torch.randn(shapes[n], dtype=torch.bfloat16) * 0.02 for n in names}, directory / file,
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return shapes


def run(kind: str, src: Path, dst: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(src), str(dst)], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                          "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        shapes = write_hf_source(root / "hf", args.layers, args.hidden, args.ffn, args.heads, args.groups, args.vocab)
        params = sum(math.prod(s) for s in shapes.values())
        largest = max(math.prod(s) for s in shapes.values())
        fused = 2 * args.ffn * args.hidden  # linear_fc1 = [gate; up], built in fp32 while writing
        print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
              f"{params / 1e6:.1f}M params ({args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
              f"vocab {args.vocab}); largest tensor {largest / 1e6:.1f}M elements")
        print("| conversion | model on disk | peak RSS above imports | = fp32 model | = largest fp32 tensor | time |")
        print("|---|---|---|---|---|---|")
        for kind, src, dst in (("hf->megafp8", "hf", "m8"), ("megafp8->hf", "m8", "hf_out"),
                               ("megafp8->hf-fp8", "m8", "fp8_out")):
            r = run(kind, root / src, root / dst)
            above = (r["peak_kib"] - r["base_kib"]) * 1024
            disk = sum(p.stat().st_size for p in (root / src).rglob("*") if p.is_file())
            print(f"| {kind} | {disk / 2**20:.0f} MiB | {above / 2**20:.0f} MiB | {above / (4 * params):.2f} x "
                  f"| {above / (4 * max(largest, fused)):.2f} x | {r['seconds']:.1f} s |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
