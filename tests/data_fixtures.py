"""Shared fixtures for the data-pipeline tests: a small embedded corpus and a tiny SentencePiece model.

Import the fixtures into a test module (``from data_fixtures import small_corpus, sp_model``). They are
built once per session (memoized here, since this module is imported once) in a pytest temp dir.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_memo: dict[str, str] = {}


@pytest.fixture
def small_corpus(tmp_path_factory) -> str:
    """jsonl of the first ~40 stdlib files (about 1 MB): real text with real document-length variety."""
    if "corpus" not in _memo:
        from megafp8.data.corpus import build_corpus

        path = str(tmp_path_factory.mktemp("corpus") / "stdlib.jsonl")
        build_corpus(path, max_docs=40, progress=False)
        _memo["corpus"] = path
    return _memo["corpus"]


@pytest.fixture
def sp_model(small_corpus, tmp_path_factory) -> str:
    """A 600-piece BPE SentencePiece model trained on ``small_corpus`` (well under a second)."""
    if "sp_model" not in _memo:
        from megafp8.data.tokenizer_training import train_sentencepiece

        prefix = str(tmp_path_factory.mktemp("tokenizer") / "sp600")
        _memo["sp_model"] = train_sentencepiece([small_corpus], prefix, 600, progress=False)
    return _memo["sp_model"]


@pytest.fixture
def text_prefix(small_corpus, sp_model, tmp_path) -> tuple[str, str]:
    """(``--data-path`` prefix, ``--tokenizer-model``): ``small_corpus`` preprocessed with ``sp_model`` by the
    user's tool, for tests that run the training entry."""
    result = run_tool("preprocess_data.py", "--input", small_corpus, "--output-prefix", str(tmp_path / "stdlib"),
                      "--json-keys", "text", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                      sp_model, "--append-eod", "--workers", "1")
    assert result.returncode == 0, result.stderr
    return str(tmp_path / "stdlib_text_document"), sp_model


def read_texts(jsonl_path: str, key: str = "text") -> list[str]:
    with open(jsonl_path, encoding="utf-8") as f:
        return [json.loads(line)[key] for line in f]


def write_lines(path, lines: list[bytes | str]) -> str:
    """Write raw jsonl lines (bytes are written as is, so a test can plant invalid UTF-8)."""
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode("utf-8")) + b"\n")
    return str(path)


def run_tool(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``python tools/<script> args`` from the repository root, as a user would."""
    return subprocess.run(
        [sys.executable, os.path.join("tools", script), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )


def write_synthetic_dataset(prefix: str, lengths: list[int] | np.ndarray, vocab_size: int = 1000, seed: int = 0):
    """An indexed dataset whose document ``i`` has ``lengths[i]`` random tokens; returns the token lists."""
    from megafp8.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype

    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, vocab_size, size=n) for n in lengths]
    with IndexedDatasetWriter(prefix, optimal_dtype(vocab_size)) as writer:
        for doc in documents:
            writer.add_document(doc)
        writer.finalize()
    return documents
