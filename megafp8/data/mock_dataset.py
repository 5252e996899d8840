"""Megatron's synthetic dataset (``--mock-data``): GPT samples cut from generated documents, no corpus needed.

The documents are Megatron-Core's ``MockGPTLowLevelDataset``: 100,000 of them, document ``i`` of length
``L_i`` drawn once from ``numpy.random.default_rng(0).integers(1, 4096)``, holding the ids ``1, 2, ..., L_i - 1``
(modulo the vocabulary size) followed by the end-of-document id. ``build_mock_datasets`` splits them as
Megatron's builder does in mock mode: a third each for train, valid and test, whatever ``--split`` says
(``BlendedMegatronDatasetConfig`` sets ``split = "1,1,1"`` when there is no blend), and samples each split with
the ordinary ``GPTDataset`` (same seed, sequence length and sample counts), so the sample stream is
``MockGPTDataset``'s, index for index.
"""
from __future__ import annotations

import numpy as np

from megafp8.data.gpt_dataset import GPTDataset
from megafp8.data.splits import SPLIT_NAMES, parse_split, split_ranges

# Megatron-Core's MockGPTLowLevelDataset constants: they define the documents, so they are the data's identity.
MOCK_SEED = 0
MOCK_SIZE = 100_000
MOCK_MAX_SEQUENCE_LENGTH = 4096
MOCK_SPLIT = "1,1,1"


class MockLowLevelDataset:
    """The generated documents, with ``IndexedDataset``'s reading interface (``sequence_lengths``, ``get``).

    A token is computed from its position, so nothing is stored but the lengths; pickled (to a data-loader
    worker) as its two ids, the lengths are drawn again there.
    """

    path_prefix = "--mock-data"  # what messages name in place of a dataset prefix

    def __init__(self, vocab_size: int, eod: int) -> None:
        if vocab_size is None or vocab_size < 1 or eod is None:
            raise ValueError("--mock-data needs a tokenizer with a vocabulary size and an end-of-document id")
        self.vocab_size, self.eod = int(vocab_size), int(eod)
        rng = np.random.default_rng(seed=MOCK_SEED)
        self.sequence_lengths = rng.integers(low=1, high=MOCK_MAX_SEQUENCE_LENGTH, size=MOCK_SIZE, dtype=np.int32)

    def __reduce__(self):
        return type(self), (self.vocab_size, self.eod)

    def __len__(self) -> int:
        return MOCK_SIZE

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of document ``idx`` (int64, as Megatron's)."""
        doc_length = int(self.sequence_lengths[idx])
        end = doc_length if length is None else min(offset + length, doc_length)
        positions = np.arange(offset, max(end, offset), dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == doc_length - 1] = self.eod
        return tokens

    def cache_identity(self) -> dict:
        """The sample indices depend on the lengths only, and those on these constants (not on the tokenizer)."""
        return {"mock_dataset": "MockGPTLowLevelDataset", "mock_seed": MOCK_SEED, "mock_size": MOCK_SIZE,
                "mock_max_sequence_length": MOCK_MAX_SEQUENCE_LENGTH}


def build_mock_datasets(
    vocab_size: int,
    eod: int,
    seq_length: int,
    seed: int,
    train_samples: int | None,
    valid_samples: int | None,
    test_samples: int | None,
    cache_dir: str | None = None,
    add_extra_token_to_sequence: bool = True,
) -> tuple[GPTDataset | None, ...]:
    """(train, valid, test) datasets of ``{"tokens": LongTensor[seq_length + 1]}`` over the mock documents,
    ``None`` for a split asked for 0 samples. Without ``cache_dir`` the indices are built in memory each run (a
    second or so), as Megatron does for mock data without ``--data-cache-path``."""
    documents = MockLowLevelDataset(vocab_size, eod)
    ranges = split_ranges(len(documents), parse_split(MOCK_SPLIT))
    built = []
    for name, (begin, end), requested in zip(SPLIT_NAMES, ranges, (train_samples, valid_samples, test_samples)):
        if requested == 0:
            built.append(None)
            continue
        built.append(GPTDataset(documents, np.arange(begin, end), requested, seq_length, seed, name, cache_dir,
                                add_extra_token_to_sequence))
    return tuple(built)
