"""Llama-3.1/3.2 RoPE scaling (rope_type "llama3") through conversion: random transformers Llamas with
Llama-3.1-8B's rope_scaling (factor 8, untied, transformers 5's ``rope_parameters`` spelling) and Llama-3.2-1B's
(factor 32, tied, Meta's ``rope_scaling`` + ``rope_theta`` spelling), with a 64-token original length and
128-token sequences, converted and loaded at TP=2 x PP=2 give transformers' logits (fp32, <= 1e-5 relative);
exported back in fp32 they are bit-identical and carry the same scaling; README's conversion commands run
verbatim on a Llama-3.1-style directory and ``--finetune`` from it trains at TP=2."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from convert_testing import convert, tiny_hf_llama  # noqa: E402
from data_fixtures import REPO_ROOT  # noqa: E402
from distributed_testing import run_distributed  # noqa: E402
from megafp8.checkpoint.manifest import read_manifest  # noqa: E402
from test_convert_hf import assert_exported_back_bit_exact, tp2_pp2_body  # noqa: E402

ORIGINAL = 64  # original_max_position_embeddings: small, so the scaled bands matter at test sizes
SEQ = 128  # past the original length
MAX_POSITIONS = 256
SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}


def llama3_hf_model(directory: Path, *, factor: float, tie: bool, meta_spelling: bool, vocab_size: int = 100):
    """A random Llama with llama3 RoPE scaling; ``meta_spelling``: config.json rewritten the way Meta's
    Llama-3.1/3.2 files spell it (``rope_scaling`` without theta, ``rope_theta`` beside it)."""
    rope = {"rope_type": "llama3", "factor": factor, **SCALING, "rope_theta": 500000.0}
    model = tiny_hf_llama(directory, tie=tie, vocab_size=vocab_size, max_position_embeddings=MAX_POSITIONS,
                          rope_parameters=rope)
    if meta_spelling:
        config = json.loads((directory / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    return model


def _expected_rope_scaling(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, **SCALING}


@pytest.mark.distributed
def test_llama31_and_llama32_scaling_at_tp2_pp2_and_back(tmp_path):
    roots = {8.0: tmp_path / "llama31", 32.0: tmp_path / "llama32"}
    llama3_hf_model(roots[8.0] / "hf", factor=8.0, tie=False, meta_spelling=False)
    llama3_hf_model(roots[32.0] / "hf", factor=32.0, tie=True, meta_spelling=True)
    for factor, root in roots.items():
        result = convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", root / "hf",
                         "--save-dir", root / "m8", "--target-tensor-parallel-size", 2,
                         "--target-pipeline-parallel-size", 2)
        assert result.returncode == 0, result.stderr
        assert (f"--use-rope-scaling --rope-scaling-factor {factor} --rope-scaling-low-freq-factor 1.0 "
                f"--rope-scaling-high-freq-factor 4.0 --rope-scaling-original-max-position-embeddings {ORIGINAL}"
                in result.stdout), result.stdout
        manifest = read_manifest(root / "m8" / "iter_0000000")
        assert manifest["args"]["use_rope_scaling"] is True and manifest["args"]["rope_scaling_factor"] == factor
    run_distributed(tp2_pp2_body, world_size=4, args=([str(r) for r in roots.values()], SEQ), timeout_s=600)
    for factor, root in roots.items():
        assert_exported_back_bit_exact(root)
        exported = json.loads((root / "hf_back" / "config.json").read_text())
        assert exported["rope_scaling"] == _expected_rope_scaling(factor) and exported["rope_theta"] == 500000.0
        original = transformers.AutoConfig.from_pretrained(root / "hf").rope_parameters
        assert transformers.AutoConfig.from_pretrained(root / "hf_back").rope_parameters == original


# ---- README's commands, verbatim, on a Llama-3.1-style directory ------------------------------------------

VOCAB = 100  # NullTokenizer: ids 0..99 plus eod = 101 entries, what the HF model has
LINKED = ("tools", "megafp8", "kernels")


def _readme_conversion_commands() -> list[str]:
    text = (Path(REPO_ROOT) / "README.md").read_text()
    section = text[text.index("## Checkpoint conversion"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    return block[: block.index("```")].strip().splitlines()


def _learnable_dataset(prefix: Path) -> None:
    """Documents counting up modulo VOCAB from random starts: a next token a tiny model learns in steps."""
    from megafp8.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(prefix), optimal_dtype(VOCAB + 1)) as writer:
        for _ in range(40):
            writer.add_document((rng.integers(0, VOCAB) + np.arange(300)) % VOCAB)
        writer.finalize()


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _first_batch_loss(hf, argv: list[str]) -> float:
    """transformers' loss on the run's first training batch, rebuilt from the run's own flags (DP = 1)."""
    from megafp8.parallel.parallel_state import ParallelState
    from megafp8.training.arguments import parse_args
    from megafp8.training.data_setup import batches, build_datasets

    args = parse_args(argv, world_size=2)
    tokens = next(batches(build_datasets(args)[0], 0, args, ParallelState().init_process_groups()))
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), tokens[:, 1:].reshape(-1)).item()


def test_readme_commands_convert_a_llama31_directory_and_finetune_trains(tmp_path, monkeypatch):
    for name in LINKED:
        (tmp_path / name).symlink_to(Path(REPO_ROOT) / name)
    hf = llama3_hf_model(tmp_path / "Llama-dir", factor=8.0, tie=False, meta_spelling=True, vocab_size=VOCAB + 1)
    to_megafp8, train, to_hf = _readme_conversion_commands()
    assert "--load-dir Llama-dir --save-dir ckpt" in to_megafp8 and "--load-dir ckpt --save-dir hf-out" in to_hf
    result = _run(to_megafp8, tmp_path)
    assert result.returncode == 0, result.stderr
    model_flags = re.search(r"--finetune (.*?) --tokenizer-", result.stdout).group(1)
    assert "--use-rope-scaling --rope-scaling-factor 8.0" in model_flags

    # README's training line with its "..." filled in: TP=2, 128-token sequences, synthetic data
    _learnable_dataset(tmp_path / "counting")
    run_flags = (f"--tensor-model-parallel-size 2 --seq-length {SEQ} --micro-batch-size 4 --train-iters 6 "
                 "--lr 1e-2 --lr-warmup-iters 0 --lr-decay-style cosine --adam-beta2 0.95 "
                 "--tokenizer-type NullTokenizer "
                 f"--vocab-size {VOCAB} --data-path counting --split 100,0,0 --eval-iters 0 --log-dir logs --save ft")
    assert train.startswith("torchrun ... -m megafp8.pretrain --load ckpt --finetune <the model flags it prints> ")
    command = (train.replace("torchrun ...", "torchrun --standalone --nproc-per-node 2")
               .replace("<the model flags it prints>", model_flags).replace(" ...", " " + run_flags))
    result = _run(command, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["lm_loss"] for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    monkeypatch.chdir(tmp_path)  # the data path is relative, as in the command
    expected = _first_batch_loss(hf, f"--load ckpt --finetune {model_flags} {run_flags}".split())
    assert abs(losses[0] - expected) <= 1e-4 * expected, (losses[0], expected)  # it trains the scaled model
    assert losses[-1] < losses[0] - 0.5, losses  # and it learns
    # the training run's manifest carries the scaling too: its HF export says so
    from megafp8.checkpoint.convert_hf import megafp8_to_hf

    megafp8_to_hf(tmp_path / "ft", tmp_path / "hf-ft", progress=False)
    assert json.loads((tmp_path / "hf-ft" / "config.json").read_text())["rope_scaling"] == _expected_rope_scaling(8.0)

    result = _run(to_hf, tmp_path)
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "hf-out" / "config.json").read_text())
    assert config["rope_scaling"] == _expected_rope_scaling(8.0) and config["torch_dtype"] == "bfloat16"
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf-out", dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(exported[k], v.to(torch.bfloat16)) for k, v in hf.state_dict().items())
