"""Bit fingerprint of a 3D FP8 training run, per recipe: the before/after check of refactors that must not move a bit.

    python tools/fp8_bits_fingerprint.py [--recipes blockwise,delayed,...] [--golden PATH] [--write-golden]

Each recipe trains a tiny Llama through the real entry (`torchrun -m megafp8.pretrain`, 8 CPU processes: TP2 x PP2
x DP2 with --sequence-parallel, the distributed optimizer with --fp8-param-gather and --fp8-grad-reduce, hybrid
FP8) for a few iterations and saves a checkpoint. Its fingerprint is the exact float hex of every logged lm loss
and grad norm (metrics.jsonl) and the dtype, shape and sha256 of the bytes of every tensor in the checkpoint,
keyed by name. Without --write-golden the fingerprints are compared with the golden file (default
tests/golden/fp8_3d_fingerprint.json) and the first differing key is printed; exit status 1 on a difference.

Regenerating the golden (--write-golden) declares a numerics change: do it only on purpose, from the code whose
bits are meant to become the new reference, and say so in the commit message. The golden is a CPU fingerprint
(gloo, the kernels' torch twins; CUDA is hidden from the run), of the installed torch version, the same on
every x86-64 CPU (PORTABLE_CPU_NUMERICS pins the instruction-set-dependent code paths).
tests/test_fp8_bits_frozen.py runs the blockwise recipe on every test run and the others as slow tests.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from megafp8.fp8.recipe import FP8_SCALINGS  # noqa: E402
from megafp8.training.megatron_flags import LLAMA_FLAGS  # noqa: E402

GOLDEN = REPO_ROOT / "tests" / "golden" / "fp8_3d_fingerprint.json"
DEFAULT_RECIPE = "delayed"  # what --fp8-recipe gives when not named
TRAIN_ITERS = 3
VOCAB_SIZE = 500
# Hidden 256 and FFN 512 (K = 256 in fprop of QKV and FC2) put two 128-wide scale groups along K; 64 tokens per
# micro-batch make wgrad's K (tokens) one 1x128 group: the GEMM whose mode the old shape guess mislabelled.
MODEL = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE), "--num-layers", "2",
         "--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--eval-iters", "0", "--log-interval", "1", "--distributed-timeout-minutes", "2", "--seed", "1234"]
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
FP8_ZERO = ["--fp8-format", "hybrid", "--use-distributed-optimizer", "--fp8-param-gather", "--fp8-grad-reduce"]
WORLD_SIZE = 8
TIMEOUT_S = 600


def launch_command(recipe: str, data_prefix: str, save: Path, log_dir: Path) -> list[str]:
    recipe_flags = [] if recipe == "default" else ["--fp8-recipe", recipe]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
            "-m", "megafp8.pretrain", *MODEL, *LAYOUT_3D, *FP8_ZERO, *recipe_flags, "--train-iters", str(TRAIN_ITERS),
            "--data-path", data_prefix, "--save", str(save), "--save-interval", str(TRAIN_ITERS),
            "--log-dir", str(log_dir)]


# The same bits on every x86-64 CPU: ATen's vectorised kernels (sums, embedding backward) and MKL's GEMMs pick
# code paths by instruction set, and an AVX-512 machine summed in another order than the AVX2 one that made the
# golden. Pinned here to ATen's scalar kernels and MKL's conditional-reproducibility mode (SSE2 paths).
PORTABLE_CPU_NUMERICS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


def _run_env() -> dict[str, str]:
    # CPU only: the golden holds the torch twins' bits, which a GPU's kernels do not reproduce.
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "MEGAFP8_KERNEL_BACKEND": "auto",
            **PORTABLE_CPU_NUMERICS}


def check_imports_come_from_this_checkout() -> None:
    """Refuse to fingerprint another tree's code: the editable install of a different checkout, or an
    unrelated PYTHONPATH, would otherwise produce a golden of code nobody meant to freeze."""
    probe = "import megafp8, megafp8_kernels; print(megafp8.__file__); print(megafp8_kernels.__file__)"
    found = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, env=_run_env(), capture_output=True,
                           text=True, check=True).stdout.split()
    foreign = [path for path in found if not Path(path).resolve().is_relative_to(REPO_ROOT)]
    if foreign:
        raise SystemExit(f"fp8_bits_fingerprint: {', '.join(foreign)} is imported instead of {REPO_ROOT}'s copy; "
                         "put this checkout (and a megafp8_kernels link to its kernels/) first on PYTHONPATH")


def write_dataset(prefix: str) -> None:
    import numpy as np

    from megafp8.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, optimal_dtype(VOCAB_SIZE)) as writer:
        for _ in range(200):
            writer.add_document(rng.integers(0, VOCAB_SIZE, size=50))
        writer.finalize()


def metrics_fingerprint(log_dir: Path) -> dict[str, dict[str, str]]:
    """{iteration: {"lm_loss": hex, "grad_norm": hex}}: exact, since json round-trips a float's repr."""
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {str(r["iteration"]): {key: float(r[key]).hex() for key in ("lm_loss", "grad_norm")}
            for r in records if "lm_loss" in r}


def checkpoint_fingerprint(save: Path) -> dict[str, str]:
    """{tensor name: "dtype[shape] sha256"} of every tensor of the last committed checkpoint under `save`."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megafp8.checkpoint.atomic import iteration_dir, read_tracker
    from megafp8.checkpoint.safe_dcp import read_metadata
    from megafp8.checkpoint.save_load import read_entries

    path = iteration_dir(save, read_tracker(save))
    entries = read_metadata(path).state_dict_metadata
    state = {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for name, meta in entries.items() if isinstance(meta, TensorStorageMetadata)}
    read_entries(state, path)
    return {name: f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} "
                  f"{hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()}"
            for name, t in sorted(state.items())}


def fingerprint(recipe: str, work_dir: Path) -> dict:
    """Train, save and fingerprint one recipe in `work_dir`."""
    prefix = str(work_dir / "synthetic_text_document")
    write_dataset(prefix)
    save, log_dir = work_dir / "checkpoints", work_dir / "logs"
    result = subprocess.run(launch_command(recipe, prefix, save, log_dir), cwd=REPO_ROOT, env=_run_env(),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"the {recipe} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return {"iterations": metrics_fingerprint(log_dir), "checkpoint": checkpoint_fingerprint(save)}


def first_difference(golden: dict, fresh: dict, prefix: str = "") -> str | None:
    """The first key (in golden order, then keys only the fresh run has) whose value differs, as a path."""
    for key in [*golden, *(k for k in fresh if k not in golden)]:
        where = f"{prefix}/{key}" if prefix else key
        if key not in golden or key not in fresh:
            return f"{where}: {golden.get(key, '<absent>')!r} (golden) != {fresh.get(key, '<absent>')!r} (now)"
        if isinstance(golden[key], dict) and isinstance(fresh[key], dict):
            found = first_difference(golden[key], fresh[key], where)
            if found:
                return found
        elif golden[key] != fresh[key]:
            return f"{where}: {golden[key]!r} (golden) != {fresh[key]!r} (now)"
    return None


def all_recipes() -> tuple[str, ...]:
    """Every FP8 --fp8-recipe choice (fp32 scales), plus "default" (no --fp8-recipe: the entry's default, delayed)."""
    return (*FP8_SCALINGS, "default")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=",".join(all_recipes()),
                        help=f"comma-separated subset of {', '.join(all_recipes())}")
    parser.add_argument("--golden", type=Path, default=GOLDEN)
    parser.add_argument("--write-golden", action="store_true",
                        help="store these fingerprints as the reference (a deliberate numerics change: say so)")
    args = parser.parse_args(argv)
    recipes = [name.strip() for name in args.recipes.split(",") if name.strip()]
    unknown = sorted(set(recipes) - set(all_recipes()))
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(unknown)}; choose from {', '.join(all_recipes())}")
    check_imports_come_from_this_checkout()
    golden = json.loads(args.golden.read_text()) if args.golden.exists() else {}
    fresh = {}
    for recipe in recipes:
        with tempfile.TemporaryDirectory(prefix=f"fp8_bits_{recipe}_") as work_dir:
            fresh[recipe] = fingerprint(recipe, Path(work_dir))
        print(f"{recipe}: {len(fresh[recipe]['iterations'])} iterations, {len(fresh[recipe]['checkpoint'])} tensors")
    if args.write_golden:
        args.golden.parent.mkdir(parents=True, exist_ok=True)
        args.golden.write_text(json.dumps({**golden, **fresh}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.golden}")
        return 0
    difference = first_difference({r: golden.get(r, {}) for r in recipes}, fresh)
    if difference:
        print(f"bits changed: {difference}")
        return 1
    print("bit-identical to the golden")
    return 0


if __name__ == "__main__":
    sys.exit(main())
