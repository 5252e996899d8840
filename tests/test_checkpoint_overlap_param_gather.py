"""A checkpoint saved with --overlap-param-gather holds the step's weights: with the overlap the all-gather
after the optimizer step is deferred to the next forward, and a save right after the step used to write each
rank's non-owned shards one step stale (a tensor-wise mix of steps N and N-1 in `model.*`, which --finetune,
--no-load-optim and the HF export read). Through the training entry (torchrun, DP=2) and the converter: the
HF export of the run with the overlap is bit-identical to the run without it, fp32 and FP8 delayed with
--fp8-param-gather."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from convert_testing import convert
from data_fixtures import REPO_ROOT, write_synthetic_dataset
from megafp8.training.megatron_flags import LLAMA_FLAGS

RUN = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-layers", "2",
       "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--lr", "1e-2", "--lr-warmup-iters", "0", "--train-iters", "2", "--eval-iters", "0",
       "--log-interval", "1", "--use-distributed-optimizer", "--distributed-timeout-minutes", "1",
       "--ddp-bucket-size", "4000"]
PRECISIONS = {"fp32": [], "fp8": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-param-gather"]}


def _train_and_export(tmp_path, prefix: str, name: str, flags: list[str]) -> dict:
    save = tmp_path / name / "checkpoints"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "megafp8.pretrain", *RUN, *flags, "--data-path", prefix, "--save", str(save)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    hf = tmp_path / name / "hf"
    converted = convert("--load-format", "megafp8", "--save-format", "hf", "--save-dtype", "fp32",
                        "--load-dir", save, "--save-dir", hf)
    assert converted.returncode == 0, converted.stderr
    tensors = {}
    for file in sorted(hf.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.distributed
# fp8 gathers high-precision buckets (norms, embedding) beside the FP8 ones: fp32 alone runs with -m slow.
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "fp8"])
def test_overlapped_param_gather_saves_the_steps_weights(tmp_path, precision):
    prefix = str(tmp_path / "synthetic_text_document")
    write_synthetic_dataset(prefix, [40] * 80, vocab_size=200)
    plain = _train_and_export(tmp_path, prefix, "plain", PRECISIONS[precision])
    overlapped = _train_and_export(tmp_path, prefix, "overlap", [*PRECISIONS[precision], "--overlap-param-gather"])
    assert plain.keys() == overlapped.keys() and len(plain) > 0
    differ = [k for k in plain if not (plain[k] == overlapped[k]).all()]
    assert not differ, f"{len(differ)} of {len(plain)} exported tensors differ with --overlap-param-gather: {differ}"
