"""Train a SentencePiece BPE tokenizer from jsonl or plain-text files, streaming the input with progress.

Defaults suit code and prose alike (Llama-style): byte fallback so no input is ever ``<unk>``, identity
normalization and no whitespace collapsing so indentation survives a round trip, digits split one by one.
Ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (the end-of-document id the preprocessing tool appends).
"""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from tqdm import tqdm

from megafp8.data.preprocess import check_input_file


@dataclass
class TextStats:
    documents: int = 0
    sentences: int = 0
    bad_lines: int = 0
    bad_line_numbers: list[tuple[str, int]] = field(default_factory=list)


def iter_sentences(
    paths: Sequence[str], json_key: str = "text", stats: TextStats | None = None, progress: bool = True
) -> Iterator[str]:
    """Non-empty lines of every document: jsonl/json files by ``json_key``, any other file line by line.

    SentencePiece learns from "sentences" and drops those over ``max_sentence_length`` bytes, so whole
    documents would mostly be skipped; their lines are the natural unit for code and prose.
    """
    stats = stats if stats is not None else TextStats()
    total = sum(os.path.getsize(p) for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc="read text", disable=not progress) as bar:
        for path in paths:
            is_json = path.endswith((".jsonl", ".json"))
            with open(path, "rb") as f:
                for line_number, raw in enumerate(f, start=1):
                    bar.update(len(raw))
                    if is_json:
                        text = _json_text(raw, json_key)
                        if text is None:
                            if raw.strip():
                                stats.bad_lines += 1
                                if len(stats.bad_line_numbers) < 5:
                                    stats.bad_line_numbers.append((path, line_number))
                            continue
                    else:
                        text = raw.decode("utf-8", errors="replace")
                    stats.documents += 1
                    for sentence in text.splitlines():
                        if sentence.strip():
                            stats.sentences += 1
                            yield sentence


def reservoir_sample(items: Iterable[str], k: int, seed: int) -> list[str]:
    """A uniform sample of ``k`` items from a stream of unknown length, in O(k) memory (Algorithm R)."""
    rng = random.Random(seed)
    sample: list[str] = []
    for i, item in enumerate(items):
        if i < k:
            sample.append(item)
        else:
            j = rng.randrange(i + 1)
            if j < k:
                sample[j] = item
    return sample


def _json_text(raw: bytes, key: str) -> str | None:
    """The line's text under ``key``, or None for a bad line: not UTF-8 or JSON, nested past the parser's limit,
    an integer of thousands of digits (Python refuses it), or a lone surrogate that no tokenizer can encode."""
    try:
        value = json.loads(raw.decode("utf-8")).get(key)
    except (ValueError, AttributeError, RecursionError):  # ValueError: UnicodeDecodeError and JSONDecodeError too
        return None
    if not isinstance(value, str):
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


def train_sentencepiece(
    inputs: Sequence[str],
    model_prefix: str,
    vocab_size: int,
    character_coverage: float = 0.9999,
    byte_fallback: bool = True,
    model_type: str = "bpe",
    json_key: str = "text",
    max_sentences: int | None = None,
    num_threads: int | None = None,
    seed_sentencepiece_size: int = 1_000_000,
    seed: int = 1234,
    progress: bool = True,
    verbose: bool = False,
) -> str:
    """Train and write ``model_prefix.model``/``.vocab``; returns the ``.model`` path."""
    import sentencepiece as spm

    if vocab_size < 8:
        raise ValueError(f"--vocab-size {vocab_size}: too small for a tokenizer")
    if not 0.0 < character_coverage <= 1.0:
        raise ValueError(f"--character-coverage {character_coverage}: must be in (0, 1]")
    for path in inputs:  # no such file, a directory, compressed or binary data: one line naming it
        check_input_file(path)
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    options = dict(
        model_prefix=model_prefix,
        model_type=model_type,
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=num_threads or os.cpu_count() or 1,
        seed_sentencepiece_size=seed_sentencepiece_size,
        minloglevel=0 if verbose else 2,
    )
    stats = TextStats()
    # The iterator is consumed by the trainer, so the input is streamed (with its progress bar) once.
    sentences = iter_sentences(inputs, json_key, stats, progress)
    if max_sentences is not None:
        # Our own seeded reservoir sample: SentencePiece's (input_sentence_size) differs run to run when
        # it trains with several threads, and a tokenizer should be reproducible from its command.
        sentences = iter(reservoir_sample(sentences, max_sentences, seed))
    spm.set_random_generator_seed(seed)
    start = time.perf_counter()
    try:
        spm.SentencePieceTrainer.Train(sentence_iterator=sentences, **options)
    except RuntimeError as exc:
        if stats.sentences == 0:
            raise ValueError(
                f"--input {', '.join(inputs)}: no text found (is --json-key {json_key!r} right?)"
            ) from None
        # e.g. "Vocabulary size is smaller than required_chars": name the flag the user can change.
        raise ValueError(
            f"SentencePiece training failed for --vocab-size {vocab_size} (byte fallback alone needs 256 "
            f"pieces; raise it or lower --character-coverage): {exc}"
        ) from None
    if stats.bad_lines:
        where = ", ".join(f"{p}:{n}" for p, n in stats.bad_line_numbers)
        print(f"skipped {stats.bad_lines} unreadable json line(s) or lines without {json_key!r} (first: {where})")
    print(
        f"trained {model_type} tokenizer (vocab {vocab_size}) on {stats.sentences} lines of "
        f"{stats.documents} documents in {time.perf_counter() - start:.1f} s: "
        f"wrote {model_prefix}.model and {model_prefix}.vocab"
    )
    return model_prefix + ".model"
