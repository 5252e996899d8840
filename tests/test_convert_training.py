"""Conversion against the training entry itself (`python -m megafp8.pretrain`, one process, fp32):
- a run trained 3 steps and saved converts to HF, and transformers reproduces the run's logged validation
  loss on the same validation batch (rebuilt with the run's own flags) within 1e-4 relative;
- a HF Llama converted to megafp8 is what `--load S --finetune` starts from: the run's first logged loss
  equals transformers' loss on the first training batch; a model flag that contradicts the checkpoint
  fails naming the flag."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from convert_testing import convert, tiny_hf_llama  # noqa: E402
from data_fixtures import REPO_ROOT, write_synthetic_dataset  # noqa: E402
from megafp8.parallel.parallel_state import ParallelState  # noqa: E402
from megafp8.training.arguments import parse_args  # noqa: E402
from megafp8.training.data_setup import batches, build_datasets  # noqa: E402
from megafp8.training.megatron_flags import LLAMA_FLAGS  # noqa: E402

VOCAB = 100  # NullTokenizer: ids 0..99 plus eod = 101 entries, what the HF model must have
MODEL = [*LLAMA_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96",
         "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
         "--max-position-embeddings", "32", "--norm-epsilon", "1e-6", "--rotary-base", "500000",
         "--untie-embeddings-and-output-weights"]
RUN = ["--micro-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "0", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", str(VOCAB), "--split", "90,10,0", "--eval-iters", "1", "--log-interval", "1"]
TOLERANCE = 1e-4


def _pretrain(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megafp8.pretrain", *flags], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _records(log_dir) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _first_batch(argv: list[str], split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's first global batch of ``split`` (one micro-batch per step here), from its own flags."""
    args = parse_args(argv)
    train, valid = build_datasets(args)
    tokens = next(batches(valid if split == "valid" else train, 0, args, ParallelState().init_process_groups()))
    return tokens[:, :-1], tokens[:, 1:]


def _hf_loss(model, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1)).item()


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "synthetic")
    lengths = torch.randint(20, 80, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    write_synthetic_dataset(prefix, lengths, vocab_size=VOCAB)
    return prefix


def test_trained_checkpoint_to_hf_reproduces_validation_loss(data_prefix, tmp_path):
    argv = [*MODEL, *RUN, "--data-path", data_prefix, "--train-iters", "3", "--eval-interval", "3",
            "--save", str(tmp_path / "run"), "--save-interval", "3", "--log-dir", str(tmp_path / "logs")]
    result = _pretrain(*argv)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [r["val_lm_loss"] for r in _records(tmp_path / "logs") if "val_lm_loss" in r]
    assert len(logged) == 1
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "run",
                     "--save-dir", tmp_path / "hf", "--save-dtype", "fp32")
    assert result.returncode == 0, result.stderr
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert hf.config.vocab_size == VOCAB + 1 and hf.config.rope_parameters["rope_theta"] == 500000
    loss = _hf_loss(hf, *_first_batch(argv, "valid"))
    assert abs(loss - logged[0]) <= TOLERANCE * logged[0], (loss, logged[0])


def test_finetune_starts_from_converted_hf_weights(data_prefix, tmp_path):
    hf = tiny_hf_llama(tmp_path / "hf", tie=False, vocab_size=VOCAB + 1)
    assert convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", tmp_path / "hf",
                   "--save-dir", tmp_path / "m8").returncode == 0
    argv = [*MODEL, *RUN, "--data-path", data_prefix, "--train-iters", "1", "--eval-interval", "100",
            "--load", str(tmp_path / "m8"), "--finetune", "--log-dir", str(tmp_path / "logs")]
    result = _pretrain(*argv)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded checkpoint" in result.stdout
    first = [r["lm_loss"] for r in _records(tmp_path / "logs") if "lm_loss" in r][0]
    expected = _hf_loss(hf, *_first_batch(argv, "train"))
    assert abs(first - expected) <= TOLERANCE * expected, (first, expected)
    # the same run with a model flag that contradicts the converted checkpoint
    wrong = list(argv)
    wrong[wrong.index("--num-query-groups") + 1] = "4"
    result = _pretrain(*wrong)
    assert result.returncode != 0 and "--num-query-groups: checkpoint 2, now 4" in result.stderr + result.stdout
