"""Tokenizers behind one small interface (Megatron names): SentencePiece, HuggingFace by local path, GPT-2 BPE, Null.

Every tokenizer exposes ``vocab_size``, ``eod`` (the id appended after each document), ``bos`` and ``pad``,
plus ``tokenize``/``tokenize_batch``/``tokenize_arrays``/``detokenize``. None adds special tokens on its own:
BOS/EOD placement is the preprocessing tool's decision (``--append-eod``), as in Megatron-LM.
"""
from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from itertools import chain
from typing import Sequence

import numpy as np

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "NullTokenizer")


class Tokenizer(ABC):
    """What the data pipeline needs from a tokenizer. Pickles as its constructor arguments."""

    vocab_size: int
    eod: int | None
    bos: int | None
    pad: int | None

    def __init__(self, *spec) -> None:
        # Rebuilt from its arguments in each worker process: native tokenizer handles don't pickle.
        self._spec = spec

    def __reduce__(self):
        return (type(self), self._spec)

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        ...

    # True when tokenize_arrays() runs in native threads with the GIL released, so one process can use
    # several cores (preprocessing then tokenizes in a thread instead of worker processes).
    native_batch_threads: bool = False

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def tokenize_arrays(self, texts: Sequence[str], num_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The ids of all ``texts`` concatenated (an integer array) and each text's token count (int64).

        ``num_threads`` is a hint for tokenizers with ``native_batch_threads``; the others ignore it.
        """
        return _flatten(self.tokenize_batch(texts))

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        ...


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model``; ``eod`` is its ``eos`` id, as Megatron's GPTSentencePieceTokenizer.

    ``pad`` is the model's pad id, or ``eod`` when the model has none (pad positions are masked anyway).
    """

    native_batch_threads = True  # Encode(list) runs in SentencePiece's C++ thread pool, GIL released

    def __init__(self, model_path: str, num_threads: int = 1) -> None:
        super().__init__(model_path, num_threads)
        import sentencepiece as spm

        _require_file(model_path, "--tokenizer-model")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"--tokenizer-model {model_path}: not a SentencePiece model ({exc})") from None
        # SentencePiece parallelizes list encoding itself; pool workers ask for 1 thread to avoid
        # oversubscribing the cores their siblings already use.
        self._num_threads = num_threads
        # sentencepiece >= 0.2.1 returns a batch as int32 buffers (no Python int per token) and reuses a
        # thread pool across calls; older versions get lists, converted in tokenize_arrays.
        self._numpy_batches = hasattr(spm, "ThreadPool") and hasattr(self._sp, "EncodeAsNumpy")
        self._thread_pools: dict[tuple[int, int], object] = {}
        self.vocab_size = self._sp.GetPieceSize()
        self.eod = _id_or_none(self._sp.eos_id())
        self.bos = _id_or_none(self._sp.bos_id())
        pad = _id_or_none(self._sp.pad_id())
        self.pad = pad if pad is not None else self.eod

    def tokenize(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.Encode(list(texts), num_threads=self._num_threads)

    def tokenize_arrays(self, texts: Sequence[str], num_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        if not self._numpy_batches or not texts:
            return _flatten(self._sp.Encode(list(texts), num_threads=num_threads))
        import sentencepiece as spm

        # Starting threads for every batch would cost per call; keyed by pid because a forked child
        # inherits the dict but not the threads.
        key = (os.getpid(), num_threads)
        if key not in self._thread_pools:
            self._thread_pools[key] = spm.ThreadPool(num_threads)
        arrays = self._sp.Encode(list(texts), num_threads=num_threads, thread_pool=self._thread_pools[key],
                                 out_type="numpy")
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        return np.concatenate(arrays), lengths

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds(list(map(int, ids)))


class HuggingFaceTokenizer(Tokenizer):
    """A HuggingFace tokenizer from a local ``tokenizer.json`` file or model directory (no downloads).

    ``tokenizers`` loads ``tokenizer.json`` directly; a directory without one goes through
    ``transformers.AutoTokenizer`` with ``local_files_only``. Special tokens come from
    ``tokenizer_config.json`` when present, else from common names (``</s>``, ``<|endoftext|>``, ...).
    """

    _EOD_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
    _BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")
    _PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")

    def __init__(self, path: str) -> None:
        super().__init__(path)
        if not os.path.exists(path):
            raise ValueError(f"--tokenizer-model {path}: no such file or directory")
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        json_file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        if os.path.isfile(json_file):
            from tokenizers import Tokenizer as FastTokenizer

            try:
                self._fast = FastTokenizer.from_file(json_file)
            except Exception as exc:  # the Rust error type is not importable; re-raise with the file name
                raise ValueError(f"--tokenizer-model {json_file}: not a tokenizers JSON file ({exc})") from None
            self._auto = None
            # encode_batch releases the GIL and runs on the tokenizers library's own (Rayon) thread pool,
            # sized by RAYON_NUM_THREADS (default: every core), not by num_threads.
            self.native_batch_threads = True
            token_to_id = self._fast.token_to_id
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
        else:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ValueError(
                    f"--tokenizer-model {path}: no tokenizer.json there, and loading other formats needs "
                    "`pip install transformers`"
                ) from None
            self._fast = None
            self._auto = AutoTokenizer.from_pretrained(path, local_files_only=True)
            # convert_tokens_to_ids maps unknown names to unk; the vocab dict says "absent" honestly.
            token_to_id = self._auto.get_vocab().get
            self.vocab_size = len(self._auto)
        self.eod = _special_id(config.get("eos_token"), self._EOD_NAMES, token_to_id)
        self.bos = _special_id(config.get("bos_token"), self._BOS_NAMES, token_to_id)
        pad = _special_id(config.get("pad_token"), self._PAD_NAMES, token_to_id)
        self.pad = pad if pad is not None else self.eod

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]
        return self._auto(list(texts), add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = list(map(int, ids))
        return self._fast.decode(ids) if self._fast is not None else self._auto.decode(ids)


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from a ``vocab.json`` and a ``merges.txt`` (Megatron's ``--tokenizer-type
    GPT2BPETokenizer --vocab-file --merge-file``); ``eod`` is ``<|endoftext|>``, as in Megatron.

    Built on ``tokenizers`` exactly as transformers' ``GPT2TokenizerFast(vocab_file, merges_file)`` is (same ids):
    a BPE model with no subword prefix or suffix, byte-level pre-tokenization without a prefix space, and
    ``<|endoftext|>`` a special token, so the literal text ``<|endoftext|>`` in a document becomes the one id.
    The vocabulary size is the vocab file's entry count (Megatron's ``len(encoder)``).
    """

    EOD = "<|endoftext|>"
    native_batch_threads = True  # encode_batch runs on the tokenizers library's own thread pool, GIL released

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__(vocab_file, merge_file)
        from tokenizers import AddedToken, Tokenizer as FastTokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE

        _require_file(vocab_file, "--vocab-file")
        _require_file(merge_file, "--merge-file")
        try:
            vocab, merges = BPE.read_file(vocab_file, merge_file)
        except Exception as exc:  # the Rust error type is not importable; re-raise naming both files
            raise ValueError(f"--vocab-file {vocab_file} --merge-file {merge_file}: not a GPT-2 vocab.json and "
                             f"merges.txt ({exc})") from None
        if self.EOD not in vocab:  # Megatron reads encoder["<|endoftext|>"] and would stop with a KeyError
            raise ValueError(f"--vocab-file {vocab_file}: has no {self.EOD} entry, GPT-2's end-of-document token")
        self._fast = FastTokenizer(BPE(vocab, merges, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
        self._fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._fast.decoder = decoders.ByteLevel()
        self._fast.add_special_tokens([AddedToken(self.EOD, special=True)])
        self.vocab_size = len(vocab)
        self.eod = vocab[self.EOD]
        self.bos = None
        self.pad = self.eod

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._fast.decode(list(map(int, ids)), skip_special_tokens=False)


class NullTokenizer(Tokenizer):
    """Megatron's NullTokenizer for synthetic data: text is space-separated ids; ``eod`` = ``vocab_size``.

    The vocabulary therefore has ``vocab_size + 1`` entries, the extra one being the end-of-document id.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        if vocab_size is None or vocab_size <= 0:
            raise ValueError("--vocab-size must be a positive integer for --tokenizer-type NullTokenizer")
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1
        self.bos = None
        self.pad = self.eod

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                token = int(word)
            except ValueError:
                raise ValueError(f"{word[:40]!r} is not a token id (NullTokenizer text is space-separated ids)") from None
            if not 0 <= token < self.vocab_size:  # stored as is, an id past the dtype would wrap
                raise ValueError(f"token id {token} is outside the vocabulary (0 .. {self.vocab_size - 1}, "
                                 f"--vocab-size {self.eod} and the end-of-document id)")
            ids.append(token)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(
    tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int | None = None, num_threads: int = 1,
    vocab_file: str | None = None, merge_file: str | None = None,
) -> Tokenizer:
    """Build a tokenizer from the Megatron-style flags ``--tokenizer-type/--tokenizer-model/--vocab-size`` (and
    ``--vocab-file/--merge-file`` for GPT2BPETokenizer)."""
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        if not tokenizer_model:
            raise ValueError(f"--tokenizer-model is required for --tokenizer-type {tokenizer_type}")
        return SentencePieceTokenizer(tokenizer_model, num_threads=num_threads)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-model (a tokenizer.json or a local model directory) is required "
                             "for --tokenizer-type HuggingFaceTokenizer")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}")


def _flatten(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    return np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())), lengths


def _require_file(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")


def _id_or_none(token_id: int) -> int | None:
    # SentencePiece reports a disabled special token as -1.
    return token_id if token_id >= 0 else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _special_id(configured, fallbacks: Sequence[str], token_to_id) -> int | None:
    if isinstance(configured, dict):  # tokenizer_config.json may hold an AddedToken as a dict
        configured = configured.get("content")
    for name in ([configured] if configured else []) + list(fallbacks):
        token_id = token_to_id(name)
        if token_id is not None and token_id >= 0:
            return int(token_id)
    return None
