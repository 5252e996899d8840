"""The training entry end to end, as a user launches it: real text (stdlib corpus, SentencePiece), the loss
goes down, metrics.jsonl holds the contract's keys, evaluation runs, bad input fails before any
process-group work with one message naming the flag or file."""
import json
import os
import subprocess
import sys

import pytest

from data_fixtures import REPO_ROOT, small_corpus, sp_model, text_prefix  # noqa: F401 (fixtures)
from megafp8.training.megatron_flags import LLAMA_FLAGS

MODEL = [*LLAMA_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads",
         "4", "--seq-length", "64", "--micro-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2", "--min-lr",
         "3e-4", "--lr-decay-style", "cosine", "--adam-beta2", "0.95"]


def _pretrain(*flags: str, nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megafp8.pretrain", *flags]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "megafp8.pretrain", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _records(log_dir) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_single_process_training_learns_and_logs(text_prefix, tmp_path):
    prefix, tokenizer = text_prefix
    result = _pretrain(*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--train-iters", "30",
                       "--eval-interval", "15", "--eval-iters", "2", "--log-dir", str(tmp_path / "logs"))
    assert result.returncode == 0, result.stderr[-3000:]
    train = [r for r in _records(tmp_path / "logs") if "lm_loss" in r]
    valid = [r for r in _records(tmp_path / "logs") if "val_lm_loss" in r]
    assert [r["iteration"] for r in train] == list(range(1, 31)) and [r["iteration"] for r in valid] == [15, 30]
    assert sum(r["lm_loss"] for r in train[-5:]) / 5 < train[0]["lm_loss"] - 1.0  # it learns the text
    assert valid[1]["val_lm_loss"] < valid[0]["val_lm_loss"]
    assert all(r["skipped_iterations"] == 0 and r["model_state_bytes_per_param"] > 0 for r in train)
    assert "iteration       30/      30 | consumed samples:          120" in result.stdout


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size (3)"),
    (["--num-attention-heads", "5"], "--num-attention-heads"),
    (["--data-path", "/nonexistent/prefix"], "/nonexistent/prefix"),
    (["--fp8-recipe", "delayed", "--first-last-layers-bf16"], "--first-last-layers-bf16 needs --fp8-format"),
    # Issue 38: tracebacks after the model was built, or nonsense trained with exit 0
    (["--split", "0,0,0"], "--split '0,0,0': expected up to three non-negative numbers with a positive sum"),
    (["--split", "abc"], "--split 'abc': expected up to three comma-separated numbers"),
    (["--split", "nan,1,1"], "--split 'nan,1,1': expected up to three non-negative numbers"),
    (["--init-method-std", "-1"], "--init-method-std must be positive, got -1.0"),
    (["--init-method-std", "nan"], "--init-method-std must be a finite number, got nan"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number, got nan"),
    (["--norm-epsilon", "-1"], "--norm-epsilon must be positive, got -1.0"),
    (["--rotary-base", "0"], "--rotary-base must be positive, got 0.0"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number, got inf"),
    (["--adam-eps", "nan"], "--adam-eps must be a finite number, got nan"),
    (["--data-path", "1e308", "A", "1e308", "B"], "--data-path weights must be positive numbers with a finite sum"),
    # the corpus' 40 documents: the training split gets none (was a traceback once the model was built)
    (["--split", "1,99999,0"], "the training split of --data-path"),
    (["--split", "1,99999,0"], "holds 0 tokens, less than one sample of --seq-length 64 + 1; change --split"),
    (["--save", "README.md"], "--save README.md: exists and is not a directory"),
    (["--save", "README.md/checkpoints"], "--save README.md/checkpoints: README.md is not a directory"),
])
def test_bad_input_fails_before_training_naming_the_cause(text_prefix, flags, message, capsys):
    """In this process (the entry's main(), as `python -m megafp8.pretrain` calls it: each case stops before any
    process group or model; a process each cost ~4 s of imports), and one case as a real process below."""
    from megafp8.pretrain import main

    prefix, tokenizer = text_prefix
    status = main([*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--train-iters", "2", *flags])
    stderr = capsys.readouterr().err
    assert status == 2 and message in stderr, stderr[-2000:]


def test_bad_input_exits_2_with_one_message_and_no_traceback(text_prefix):
    prefix, tokenizer = text_prefix
    result = _pretrain(*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--train-iters", "2",
                       "--split", "1,99999,0")
    assert result.returncode == 2 and "holds 0 tokens" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_fp8_run_writes_per_layer_telemetry_to_tensorboard(text_prefix, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prefix, tokenizer = text_prefix
    result = _pretrain(*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--train-iters", "4",
                       "--eval-iters", "0", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                       "--fp8-amax-history-len", "4", "--log-fp8-telemetry", "--log-interval", "2",
                       "--tensorboard-dir", str(tmp_path / "tb"))
    assert result.returncode == 0, result.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/lm_loss" in tags
    saturated = [t for t in tags if t.startswith("fp8/") and "linear_fc1/input/" in t]
    assert saturated, tags  # per layer and role, at the logged iterations 2 and 4
    assert [e.step for e in events.Scalars(saturated[0])] == [2, 4]


@pytest.mark.parametrize("vocab_size, tp", [(300, 2), (590, 1)])
def test_token_ids_past_the_vocabulary_fail_before_training(text_prefix, tmp_path, vocab_size, tp):
    """Data tokenized with a 600-piece SentencePiece model, trained as --vocab-size N: at TP=2 the vocab-parallel
    embedding would mask the foreign ids to row 0 and train silently; at TP=1 ids 590..599 would land in the
    padding rows (590 + eod padded to 640). One line naming the prefix and the id, exit 2, before any process group;
    the verdict is cached beside the index arrays for the next start."""
    import glob

    prefix, _ = text_prefix
    # Rank 0 of a 2-process torchrun job (the checks run before any process group, so no peer is needed).
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *MODEL, "--data-path", prefix, "--tokenizer-type",
                             "NullTokenizer", "--vocab-size", str(vocab_size), "--train-iters", "2",
                             "--global-batch-size", str(4 * 2 // tp), "--tensor-model-parallel-size", str(tp),
                             "--log-dir", str(tmp_path / "logs")], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--data-path {prefix}: token id 599 is past the tokenizer's vocabulary ({vocab_size + 1} ids" \
        in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "logs" / "metrics.jsonl").exists()
    cached = glob.glob(os.path.join(os.path.dirname(prefix), "cache", "*-token-range.json"))
    assert len(cached) == 1 and json.load(open(cached[0]))["max"] == 599


def test_a_damaged_index_cache_is_rebuilt_not_trained_on(text_prefix, tmp_path):
    """Issue 38 item 8: every cached index array (shuffle, sample and document indices) overwritten with zeros of
    the same size, or truncated: the next run says so, rebuilds them and trains on exactly the first run's samples."""
    import glob

    prefix, tokenizer = text_prefix
    flags = [*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--train-iters", "3", "--eval-iters", "0"]

    def losses(run):
        result = _pretrain(*flags, "--log-dir", str(tmp_path / run))
        assert result.returncode == 0, result.stderr[-3000:]
        return [r["lm_loss"] for r in _records(tmp_path / run)], result.stderr

    first, _ = losses("first")
    arrays = sorted(glob.glob(os.path.join(os.path.dirname(prefix), "cache", "*.npy")))
    assert any("shuffle_index" in a for a in arrays) and any("sample_index" in a for a in arrays), arrays
    for i, path in enumerate(arrays):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            if i % 2:
                f.truncate(size // 2)
            else:
                f.seek(128)  # past the .npy header: the values themselves
                f.write(b"\0" * (size - 128))
    second, stderr = losses("second")
    assert "is damaged or incomplete: rebuilding it" in stderr and "Traceback" not in stderr
    assert second == first
    third, stderr = losses("third")  # the rebuilt cache is whole again
    assert third == first and "damaged" not in stderr


def test_an_empty_validation_split_is_named_and_a_float_dataset_refused(text_prefix, tmp_path):
    import numpy as np

    from megafp8.data.indexed_dataset import IndexedDatasetWriter

    prefix, tokenizer = text_prefix
    result = _pretrain(*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--train-iters", "3",
                       "--split", "100,0,0", "--eval-iters", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "warning: --eval-iters 1: --split 100,0,0 leaves no validation documents" in result.stderr
    floats = str(tmp_path / "floats")
    with IndexedDatasetWriter(floats, np.float64) as writer:  # dtype code 6: valid Megatron, not token ids
        writer.add_document(np.arange(200, dtype=np.float64) + 0.5)
        writer.finalize()
    result = _pretrain(*MODEL, "--data-path", floats, "--tokenizer-model", tokenizer, "--train-iters", "3")
    assert result.returncode == 2 and f"--data-path {floats}: holds float64 values, not token ids" in result.stderr
    assert "Traceback" not in result.stderr


def test_keep_last_through_the_entry_leaves_directories_it_did_not_write(text_prefix, tmp_path):
    """Issue 38 item 11, as a user meets it: --keep-last prunes megafp8's checkpoints, and an iter_* folder of the
    user's (no manifest) in --save survives, contents and all."""
    prefix, tokenizer = text_prefix
    save = tmp_path / "checkpoints"
    mine = save / "iter_0000100"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("not a checkpoint")
    result = _pretrain(*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--train-iters", "3",
                       "--eval-iters", "0", "--save", str(save), "--save-interval", "1", "--keep-last", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000003", "iter_0000100"]
    assert (mine / "notes.txt").read_text() == "not a checkpoint"
