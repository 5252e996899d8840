"""Tokenizers (SentencePiece, HuggingFace by path, Null), SentencePiece training, and the embedded corpus."""
from __future__ import annotations

import json
import os
import pickle

import pytest

from data_fixtures import read_texts, run_tool, small_corpus, sp_model  # noqa: F401 (fixtures)
from megafp8.data.corpus import build_corpus, docstrings_of
from megafp8.data.tokenizer import HuggingFaceTokenizer, NullTokenizer, SentencePieceTokenizer, build_tokenizer


def test_sentencepiece_round_trip_and_special_ids(sp_model, small_corpus):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == 600 and tok.eod == 2 and tok.bos == 1 and tok.pad == tok.eod
    text = read_texts(small_corpus)[3]
    # identity normalization + byte fallback: source code (indentation, non-ASCII) survives exactly
    for sample in (text, "    x = 'ünïcode → 日本'\n\tdone\n"):
        ids = tok.tokenize(sample)
        assert max(ids) < tok.vocab_size and tok.detokenize(ids) == sample
    assert tok.tokenize_batch([text, "a b"]) == [tok.tokenize(text), tok.tokenize("a b")]


def test_tokenizer_pickles_as_its_arguments(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize("def f(): pass") == tok.tokenize("def f(): pass")


def test_huggingface_tokenizer_from_local_path(tmp_path, small_corpus):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    fast = Tokenizer(models.BPE(unk_token="<unk>"))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    fast.train_from_iterator(read_texts(small_corpus)[:10], trainer)
    fast.save(str(tmp_path / "tokenizer.json"))

    for path in (str(tmp_path / "tokenizer.json"), str(tmp_path)):  # the file, or its directory
        tok = build_tokenizer("HuggingFaceTokenizer", path)
        assert isinstance(tok, HuggingFaceTokenizer)
        assert (tok.eod, tok.bos, tok.pad) == (2, 1, 3)
        assert tok.tokenize("def main():") == fast.encode("def main():", add_special_tokens=False).ids

    # tokenizer_config.json names the special tokens when present, as transformers writes it
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": {"content": "<pad>"}}, f)
    assert build_tokenizer("HuggingFaceTokenizer", str(tmp_path)).eod == 3


def test_null_tokenizer_matches_megatron():
    tok = NullTokenizer(100)
    assert tok.tokenize("1 2  99") == [1, 2, 99]
    assert tok.eod == 100 and tok.vocab_size == 101


@pytest.mark.parametrize(
    "args, message",
    [
        (("WordPieceTokenizer", None), "--tokenizer-type 'WordPieceTokenizer' is not supported"),
        (("SentencePieceTokenizer", None), "--tokenizer-model is required"),
        (("SentencePieceTokenizer", "/nonexistent/tok.model"), "--tokenizer-model /nonexistent/tok.model"),
        (("HuggingFaceTokenizer", "/nonexistent"), "no such file or directory"),
        (("NullTokenizer", None), "--vocab-size"),
    ],
)
def test_bad_tokenizer_flags_name_the_flag(args, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(*args)


def test_corrupt_sentencepiece_model_is_reported(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", str(bad))


def test_corpus_is_deterministic_one_document_per_file(tmp_path):
    first, second = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    stats = build_corpus(first, max_docs=12, progress=False)
    build_corpus(second, max_docs=12, progress=False)
    with open(first, "rb") as f, open(second, "rb") as g:
        assert f.read() == g.read()
    records = [json.loads(line) for line in open(first, encoding="utf-8")]
    paths = [r["path"] for r in records]
    assert stats.documents == len(records) == 12
    assert len(set(paths)) == 12 and all(p.endswith(".py") for p in paths)
    assert paths == sorted(paths, key=lambda p: p.split("/"))  # sorted walk: files before subfolders' files


def test_corpus_limits_and_docstrings(tmp_path):
    path = str(tmp_path / "c.jsonl")
    stats = build_corpus(path, max_bytes=50_000, progress=False)
    assert 50_000 <= stats.bytes < 50_000 + 300_000  # stops after the document that crosses the limit
    assert docstrings_of('"""Module."""\ndef f():\n    """Does f."""\n') == "Module.\n\nDoes f."
    with pytest.raises(ValueError, match="--content"):
        build_corpus(path, content="binaries", progress=False)


def test_train_tokenizer_tool(tmp_path, small_corpus):
    """The command from docs/data.md, end to end: a 300-piece model that encodes the corpus losslessly."""
    prefix = str(tmp_path / "tok")
    result = run_tool("train_tokenizer.py", "--input", small_corpus, "--model-prefix", prefix,
                      "--vocab-size", "500", "--max-sentences", "5000")
    assert result.returncode == 0, result.stderr
    assert os.path.isfile(prefix + ".model") and os.path.isfile(prefix + ".vocab")
    tok = SentencePieceTokenizer(prefix + ".model")
    text = read_texts(small_corpus)[0]
    assert tok.vocab_size == 500 and tok.detokenize(tok.tokenize(text)) == text


def test_train_tokenizer_reports_bad_input(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"other": "x"}\n')
    result = run_tool("train_tokenizer.py", "--input", str(empty), "--model-prefix", str(tmp_path / "t"),
                      "--vocab-size", "300")
    assert result.returncode == 1 and "no text found" in result.stderr
    result = run_tool("train_tokenizer.py", "--input", str(tmp_path / "missing.jsonl"),
                      "--model-prefix", str(tmp_path / "t"), "--vocab-size", "300")
    assert result.returncode == 1 and "missing.jsonl: no such file" in result.stderr


def test_huggingface_directory_without_tokenizer_json_goes_through_transformers(tmp_path):
    """A GPT-2 style directory (vocab.json + merges.txt) loads with transformers.AutoTokenizer, offline."""
    pytest.importorskip("transformers")
    from tokenizers import ByteLevelBPETokenizer

    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(["def f(x): return x", "hello world"] * 50, vocab_size=300,
                                special_tokens=["</s>", "<pad>"])
    trained.save_model(str(tmp_path))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "eos_token": "</s>", "pad_token": "<pad>"}, f)
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert (tok.eod, tok.pad, tok.bos) == (0, 1, None)
    assert tok.tokenize("def f(x): return x") == trained.encode("def f(x): return x").ids


def test_tokenizer_training_is_reproducible_with_a_line_sample(tmp_path, small_corpus):
    import sentencepiece as spm

    from megafp8.data.tokenizer_training import train_sentencepiece

    vocabularies = []
    for name in ("a", "b"):
        model = train_sentencepiece([small_corpus], str(tmp_path / name), 500, max_sentences=3000, progress=False)
        sp = spm.SentencePieceProcessor(model_file=model)
        vocabularies.append([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    assert vocabularies[0] == vocabularies[1]


def test_train_tokenizer_skips_hostile_lines_and_refuses_compressed_input(tmp_path, small_corpus):
    """Issue 38 items 7 and 12: a lone surrogate, JSON nested 200,000 deep and a 5000-digit integer are skipped
    bad lines (they failed the run, blaming --vocab-size); a .gz file is refused (it trained on the compressed
    bytes)."""
    import gzip
    import json as json_module

    hostile = tmp_path / "hostile.jsonl"
    good = [json_module.dumps({"text": t}) for t in read_texts(small_corpus)[:3]]
    hostile.write_text("\n".join(good[:1] + ['{"text": "a\\ud800b"}', "[" * 200_000, "9" * 5000] + good[1:]) + "\n")
    result = run_tool("train_tokenizer.py", "--input", str(hostile), "--model-prefix", str(tmp_path / "t"),
                      "--vocab-size", "400")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "skipped 3 unreadable json line(s)" in result.stdout and f"{hostile}:2" in result.stdout
    packed = tmp_path / "corpus.jsonl.gz"
    packed.write_bytes(gzip.compress(hostile.read_bytes()))
    result = run_tool("train_tokenizer.py", "--input", str(packed), "--model-prefix", str(tmp_path / "z"),
                      "--vocab-size", "400")
    assert result.returncode == 1 and "gzip-compressed data; decompress it first" in result.stderr
    assert not (tmp_path / "z.model").exists()
