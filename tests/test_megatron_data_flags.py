"""Megatron-LM's data and logging flags behave as in Megatron (issue 30): --mock-data is megatron-core's synthetic
sample stream, --data-cache-path holds every index cache, --num-workers and --no-mmap-bin-files read the same
batches, GPT2BPETokenizer gives transformers' ids, and --wandb-project logs offline (or says what to install)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data_fixtures import REPO_ROOT, read_texts, run_tool, write_synthetic_dataset
from megafp8.data.builder import build_train_valid_test_datasets
from megafp8.data.indexed_dataset import IndexedDataset
from megafp8.data.tokenizer import build_tokenizer
from megafp8.training.arguments import parse_and_check
from megafp8.training.data_setup import batches, build_datasets, close_batches, tokenizer_vocab_size

try:  # the block Megatron-LM's Llama scripts describe (megafp8.training.megatron_flags)
    from megafp8.training.megatron_flags import LLAMA_FLAGS
except ImportError:
    LLAMA_FLAGS = ()

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--lr", "1e-3", *LLAMA_FLAGS]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]
TIMEOUT = 300


def _args(*flags: str, world_size: int = 1):
    args, errors, _ = parse_and_check([*MODEL, *flags], world_size)
    assert errors == [], errors
    return args


def _dp(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(data_parallel_rank=rank, dp_size=size)


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _pretrain(*flags: str, nproc: int = 0, prelude: str = "", **env: str) -> subprocess.CompletedProcess:
    """The training entry as a user runs it: `python -m megafp8.pretrain`, or torchrun with `nproc` processes
    (`prelude`: Python run first in a plain process, e.g. to hide a package)."""
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "megafp8.pretrain"]
    elif prelude:
        command = [sys.executable, "-c", f"{prelude}\nimport sys\nfrom megafp8.pretrain import main\n"
                                         "sys.exit(main(sys.argv[1:]))"]
    else:
        command = [sys.executable, "-m", "megafp8.pretrain"]
    return subprocess.run([*command, *MODEL, *flags], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env(**env))


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def _losses(log_dir: Path) -> dict[int, float]:
    """{iteration: training loss} and {-iteration: validation loss} of a run's metrics.jsonl."""
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return ({r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}
            | {-r["iteration"]: r["val_lm_loss"] for r in records if "val_lm_loss" in r})


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "synthetic_text_document")
    write_synthetic_dataset(prefix, np.random.default_rng(0).integers(20, 300, 200), vocab_size=500)
    return prefix


# ---- --mock-data --------------------------------------------------------------------------------------------
class _MegatronTokenizer:
    """What megatron-core's dataset config reads of a tokenizer (no pad id: Megatron then pads with -1)."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = {"class": "megafp8 test", "vocab_size": vocab_size, "eod": eod}


@pytest.mark.parametrize("vocab_size, seq_length", [(500, 32), (50000, 128)])
def test_mock_data_is_megatron_cores_mock_dataset(vocab_size, seq_length):
    """The train and valid splits the entry builds (build_datasets) hold megatron-core's MockGPTDataset samples,
    index for index: the same documents, split a third each whatever --split says, the same sample order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    args = _args("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size),
                 "--seq-length", str(seq_length), "--global-batch-size", "8", "--train-iters", "500",
                 "--eval-interval", "100", "--eval-iters", "10", "--split", "98,2,0", "--seed", "77")
    train, valid = build_datasets(args)
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=vocab_size)  # Megatron's: vocab + 1 ids, eod = vocab
    assert (tokenizer.vocab_size, tokenizer.eod) == (vocab_size + 1, vocab_size)

    config = GPTDatasetConfig(random_seed=77, sequence_length=seq_length, blend=None, split="98,2,0",
                              tokenizer=_MegatronTokenizer(tokenizer.vocab_size, tokenizer.eod),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sizes = [args.train_samples, (500 // 100 + 1) * 10 * 8, 0]
        megatron = BlendedMegatronDatasetBuilder(MockGPTDataset, sizes, lambda: True, config).build()
    rng = np.random.default_rng(0)
    for ours, theirs in ((train, megatron[0]), (valid, megatron[1])):
        assert len(ours) == len(theirs)
        for i in [*range(64), *rng.integers(0, len(ours), 64).tolist(), len(ours) - 1]:
            sample = theirs[i]
            expected = torch.cat([sample["tokens"], sample["labels"][-1:]])
            assert torch.equal(ours[i]["tokens"], expected), i


def test_mock_data_trains_through_the_entry(tmp_path):
    """No corpus and no --data-path: a NullTokenizer run trains and evaluates; --data-cache-path keeps its indices
    (Megatron builds mock indices in memory otherwise), and a second run reads them."""
    logs, cache = tmp_path / "logs", tmp_path / "cache"
    run = ["--mock-data", *NULL_TOKENIZER, "--global-batch-size", "4", "--train-iters", "3", "--eval-interval", "2",
           "--eval-iters", "1", "--log-dir", str(logs)]
    _ok(_pretrain(*run))
    first = _losses(logs)
    assert sorted(first) == [-2, 1, 2, 3] and all(np.isfinite(v) for v in first.values())
    (logs / "metrics.jsonl").unlink()
    _ok(_pretrain(*run, "--data-cache-path", str(cache)))
    assert _losses(logs) == first
    names = sorted(p.name for p in cache.iterdir())
    assert any("GPTDataset-train" in n for n in names) and any("GPTDataset-valid" in n for n in names), names


# ---- --data-cache-path ----------------------------------------------------------------------------------------
def test_data_cache_path_holds_every_cache_and_nothing_goes_beside_the_data(data_prefix, tmp_path):
    """Sample indices, the blend's indices and the token-id range check: all under --data-cache-path."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a", "b"):
        for ext in (".bin", ".idx"):
            shutil.copy(data_prefix + ext, data / (name + ext))
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    _ok(_pretrain(*NULL_TOKENIZER, "--data-path", "0.3", str(data / "a"), "0.7", str(data / "b"),
                  "--data-cache-path", str(cache), "--global-batch-size", "4", "--train-iters", "2",
                  "--eval-iters", "0", "--log-dir", str(logs)))
    assert sorted(p.name for p in data.iterdir()) == ["a.bin", "a.idx", "b.bin", "b.idx"]
    names = [p.name for p in cache.iterdir()]
    for kind in ("GPTDataset-train", "BlendedDataset", "token-range"):
        assert any(kind in n for n in names), (kind, names)


# ---- --no-mmap-bin-files ----------------------------------------------------------------------------------------
def test_no_mmap_bin_files_reads_the_same_tokens(data_prefix, tmp_path):
    mapped, read = IndexedDataset(data_prefix), IndexedDataset(data_prefix, mmap=False)
    assert not isinstance(read.get(3), np.memmap) and read.token_id_range() == mapped.token_id_range()
    for i in range(len(mapped)):
        assert np.array_equal(read[i], mapped[i])
        assert np.array_equal(read.get(i, 5, 7), mapped.get(i, 5, 7))
    assert pickle.loads(pickle.dumps(read)).mmap is False  # a data-loader worker reads as the flag says
    counts = dict(seq_length=32, seed=5, train_samples=300, valid_samples=20, test_samples=0,
                  cache_dir=str(tmp_path / "cache"))
    a = build_train_valid_test_datasets([data_prefix], "90,10,0", **counts)
    b = build_train_valid_test_datasets([data_prefix], "90,10,0", **counts, mmap_bin_files=False)
    assert b[0].dataset.mmap is False
    for x, y in zip(a[:2], b[:2]):
        assert len(x) == len(y) and all(torch.equal(x[i]["tokens"], y[i]["tokens"]) for i in range(len(x)))


# ---- --num-workers ------------------------------------------------------------------------------------------------
def _stream(dataset, consumed: int, args, dp_size: int, count: int, cycle: bool = False) -> list[torch.Tensor]:
    sources = [batches(dataset, consumed, args, _dp(r, dp_size), cycle=cycle) for r in range(dp_size)]
    try:
        return [torch.cat([next(s) for s in sources]) for _ in range(count)]
    finally:
        close_batches(*sources)


@pytest.mark.parametrize("mock", [False, True])
def test_num_workers_gives_the_batches_of_num_workers_0(mock, data_prefix):
    """The entry's data code (build_datasets, batches): every DP rank's micro-batches, from a resume point and
    through the validation split's wrap-around, are the same read by 2 worker processes as in-process."""
    data = ["--mock-data"] if mock else ["--data-path", data_prefix, "--split", "80,20,0"]
    flags = [*data, *NULL_TOKENIZER, "--global-batch-size", "8", "--train-iters", "20", "--eval-iters", "2",
             "--eval-interval", "5"]
    in_process, workers = _args(*flags, world_size=2), _args(*flags, "--num-workers", "2", world_size=2)
    assert (in_process.num_workers, workers.num_workers) == (0, 2)
    train, valid = build_datasets(workers)
    for consumed in (0, 36):
        assert all(torch.equal(a, b) for a, b in zip(_stream(train, consumed, in_process, 2, 6),
                                                      _stream(train, consumed, workers, 2, 6)))
    wrapped = len(valid) - 2  # a resume point just before the split ends: the stream starts it over
    assert all(torch.equal(a, b) for a, b in zip(_stream(valid, wrapped, in_process, 2, 4, cycle=True),
                                                  _stream(valid, wrapped, workers, 2, 4, cycle=True)))


def _worker_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_close_batches_stops_the_worker_processes(data_prefix):
    pytest.importorskip("psutil")
    args = _args("--data-path", data_prefix, *NULL_TOKENIZER, "--global-batch-size", "2", "--train-iters", "10",
                 "--eval-iters", "0", "--num-workers", "2")
    train, _ = build_datasets(args)
    before = _worker_pids()
    source = batches(train, 0, args, _dp(0, 1))
    next(source)
    assert len(_worker_pids() - before) == 2
    close_batches(source)
    assert _worker_pids() - before == set()


@pytest.mark.distributed
@pytest.mark.slow  # CI time (the 30-minute budget): the workers' batches are checked by default below
def test_num_workers_under_torchrun_resumes_the_straight_run(data_prefix, tmp_path):
    """Two gloo ranks (DP 2): a run with 2 data-loader workers per rank, --no-mmap-bin-files and --data-cache-path,
    stopped after 2 iterations and resumed from its checkpoint, logs the losses of a straight in-process run."""
    common = ["--data-path", data_prefix, *NULL_TOKENIZER, "--global-batch-size", "8", "--eval-interval", "2",
              "--eval-iters", "1"]
    straight, resumed, save = tmp_path / "straight", tmp_path / "resumed", tmp_path / "ckpt"
    _ok(_pretrain(*common, "--train-iters", "4", "--log-dir", str(straight), nproc=2))
    workers = [*common, "--train-iters", "4", "--num-workers", "2", "--no-mmap-bin-files", "--data-cache-path",
               str(tmp_path / "cache"), "--save", str(save), "--log-dir", str(resumed)]
    _ok(_pretrain(*workers, "--exit-interval", "2", nproc=2))  # saves iteration 2 and stops
    out = _ok(_pretrain(*workers, "--load", str(save), nproc=2))
    assert "(iteration 2)" in out
    assert sorted(_losses(straight)) == [-4, -2, 1, 2, 3, 4] and _losses(resumed) == _losses(straight)


# ---- GPT2BPETokenizer ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    """A 600-entry byte-level BPE trained here, saved as GPT-2's vocab.json and merges.txt."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megafp8.data.corpus import build_corpus

    directory = tmp_path_factory.mktemp("gpt2")
    corpus = str(directory / "corpus.jsonl")
    build_corpus(corpus, max_docs=10, progress=False)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(read_texts(corpus), trainer)
    tokenizer.model.save(str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def _texts(corpus: str) -> list[str]:
    return [*read_texts(corpus), " leading space", "a<|endoftext|>b", "ünïcödé ∑ 中文 🙂", "tab\there\r\n", ""]


def test_gpt2_bpe_ids_are_transformers(gpt2_files):
    """GPT2BPETokenizer (--vocab-file, --merge-file) gives the ids, the vocabulary size and the end-of-document id
    of transformers' GPT2TokenizerFast on the same two files; the training entry's vocabulary is that size."""
    transformers = pytest.importorskip("transformers")
    vocab_file, merge_file = gpt2_files
    reference = transformers.GPT2TokenizerFast.from_pretrained(os.path.dirname(vocab_file))
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    texts = _texts(os.path.join(os.path.dirname(vocab_file), "corpus.jsonl"))
    assert ours.tokenize_batch(texts) == reference(texts, add_special_tokens=False)["input_ids"]
    assert ours.vocab_size == len(reference) == 600 and ours.eod == reference.eos_token_id
    assert ours.detokenize(ours.tokenize(texts[0])) == texts[0]
    assert pickle.loads(pickle.dumps(ours)).tokenize(texts[1]) == ours.tokenize(texts[1])
    args = SimpleNamespace(tokenizer_type="GPT2BPETokenizer", tokenizer_model=None, vocab_size=None,
                           vocab_file=vocab_file, merge_file=merge_file)
    assert tokenizer_vocab_size(args) == 600


def test_gpt2_bpe_errors_name_the_flags(gpt2_files, tmp_path):
    vocab_file, merge_file = gpt2_files
    with pytest.raises(ValueError, match="needs --vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file)
    with pytest.raises(ValueError, match="--merge-file .*missing.txt: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=str(tmp_path / "missing.txt"))
    no_eod = tmp_path / "vocab.json"
    vocab = json.loads(Path(vocab_file).read_text())
    del vocab["<|endoftext|>"]
    no_eod.write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="has no <|endoftext|> entry"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(no_eod), merge_file=merge_file)


def test_preprocess_and_train_with_megatrons_gpt2_flags(gpt2_files, tmp_path):
    """tools/preprocess_data.py takes Megatron's GPT-2 flags (each document is its transformers ids plus
    <|endoftext|>), and the training entry trains on the result with the same flags."""
    transformers = pytest.importorskip("transformers")
    vocab_file, merge_file = gpt2_files
    corpus = os.path.join(os.path.dirname(vocab_file), "corpus.jsonl")
    result = run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", str(tmp_path / "gpt2"),
                      "--json-keys", "text", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
                      "--merge-file", merge_file, "--append-eod", "--workers", "1")
    assert result.returncode == 0, result.stderr
    reference = transformers.GPT2TokenizerFast.from_pretrained(os.path.dirname(vocab_file))
    dataset = IndexedDataset(str(tmp_path / "gpt2_text_document"))
    texts = read_texts(corpus)
    assert len(dataset) == len(texts)
    for i, text in enumerate(texts):
        assert dataset[i].tolist() == reference(text, add_special_tokens=False)["input_ids"] + [reference.eos_token_id]
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file]
    out = _ok(_pretrain("--data-path", str(tmp_path / "gpt2_text_document"), *gpt2, "--global-batch-size", "2",
                        "--train-iters", "1", "--eval-iters", "0"))
    assert "megafp8: trained 1 iterations" in out


# ---- --wandb-project ---------------------------------------------------------------------------------------------
def test_wandb_without_the_package_is_one_message(data_prefix):
    result = _pretrain("--data-path", data_prefix, *NULL_TOKENIZER, "--global-batch-size", "4", "--train-iters", "1",
                       "--wandb-project", "megafp8-test", prelude="import sys; sys.modules['wandb'] = None")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("megafp8-pretrain: error:") == 1
    assert "--wandb-project" in result.stderr and "pip install wandb" in result.stderr, result.stderr


def test_wandb_offline_run_logs_the_tensorboard_scalars(data_prefix, tmp_path):
    pytest.importorskip("wandb")
    wandb_dir, logs = tmp_path / "wandb", tmp_path / "logs"
    out = _ok(_pretrain("--data-path", data_prefix, *NULL_TOKENIZER, "--global-batch-size", "4", "--train-iters", "2",
                        "--eval-interval", "2", "--eval-iters", "1", "--log-dir", str(logs),
                        "--wandb-project", "megafp8-test", "--wandb-exp-name", "offline-smoke",
                        "--wandb-save-dir", str(wandb_dir), WANDB_MODE="offline", WANDB_SILENT="true"))
    assert "wandb project megafp8-test" in out
    runs = list((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(wandb_dir.rglob("*"))
    history = runs[0].read_bytes()
    for tag in (b"train/lm_loss", b"train/lr", b"train/grad_norm", b"train/tokens_per_s", b"validation/lm_loss"):
        assert tag in history, tag
    assert b"offline-smoke" in history and b"megafp8-test" in history
