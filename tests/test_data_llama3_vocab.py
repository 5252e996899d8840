"""Llama-3-sized data: a HF tokenizer.json of 128,100 entries (a byte-level BPE trained on the stdlib, its ids
spread over Llama-3's 128,000 regular ids, specials from 128,000 with <|end_of_text|> = 128,001) ->
tools/preprocess_data.py -> int32 .bin/.idx that megatron-core's IndexedDataset reads back as `tokenizers`' own
ids; then megafp8.pretrain trains on it at TP=2 with the vocab padded to 128,256."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp

from data_fixtures import REPO_ROOT, read_texts, run_tool
from megafp8.training.megatron_flags import LLAMA_FLAGS

tokenizers = pytest.importorskip("tokenizers")
megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")

REGULAR_IDS = 128000  # Llama-3's BPE vocabulary; its special tokens follow
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(98)]


def llama3_sized_tokenizer(texts: list[str], path: str) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on ``texts`` (2,000 tokens: seconds, where training 128k merges would take
    minutes) whose token ids are spread evenly over [0, 128000) -- so most text uses ids past uint16's range --
    with the ids between held by unused entries, then Llama-3-style special tokens from 128,000 on."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = decoders.ByteLevel()
    trained.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    stride = REGULAR_IDS // len(vocab)
    spread = {token: i * stride for token, i in vocab.items()}
    taken = set(spread.values())
    spread.update({f"<|unused_{i}|>": i for i in range(REGULAR_IDS) if i not in taken})
    spec["model"]["vocab"] = spread
    tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(path)
    return tokenizer


def test_llama3_sized_vocab_preprocesses_to_int32_and_trains_at_tp2(tmp_path):
    from megafp8.data.corpus import build_corpus
    from megafp8.model.config import ModelConfig

    corpus = str(tmp_path / "corpus.jsonl")
    build_corpus(corpus, max_docs=12, progress=False)
    texts = read_texts(corpus)
    tokenizer_json = str(tmp_path / "tokenizer.json")
    reference = llama3_sized_tokenizer(texts, tokenizer_json)
    vocab_size, eod = reference.get_vocab_size(), reference.token_to_id("<|end_of_text|>")
    assert (vocab_size, eod) == (128100, 128001)

    prefix = str(tmp_path / "llama3")
    result = run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--json-keys", "text",
                      "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_json,
                      "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr
    theirs = megatron_indexed.IndexedDataset(prefix + "_text_document")
    assert theirs.index.dtype == np.int32  # Megatron's rule: int32 from a vocabulary of 65,500 on
    expected = [e.ids + [eod] for e in reference.encode_batch(texts, add_special_tokens=False)]
    assert len(theirs) == len(expected)
    assert all(theirs[i].tolist() == ids for i, ids in enumerate(expected))
    content = np.concatenate([theirs[i][:-1] for i in range(len(theirs))])
    assert (content > 65535).mean() > 0.1  # ids a uint16 file would have wrapped

    # TP=2: 128,100 padded to a multiple of 128 x 2 = 128,256 (Llama-3's own size); the checkpoint keeps 128,100
    assert ModelConfig(vocab_size=vocab_size).padded_vocab_size(2) == 128256
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megafp8.pretrain", *LLAMA_FLAGS, "--tensor-model-parallel-size", "2", "--num-layers", "2",
               "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "4", "--seq-length", "64",
               "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-2", "--lr-warmup-iters", "0",
               "--lr-decay-style", "cosine", "--adam-beta2", "0.95", "--eval-iters", "0",
               "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_json,
               "--data-path", prefix + "_text_document", "--untie-embeddings-and-output-weights",
               "--log-dir", str(tmp_path / "logs"), "--save", str(tmp_path / "ckpt")]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["lm_loss"] for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and abs(losses[0] - math.log(vocab_size)) < 0.1, losses  # near-uniform at init
    assert losses[-1] < losses[0] - 0.3, losses  # and it learns (measured: 11.77 -> 11.22 in 4 steps)
    metadata = dcp.FileSystemReader(str(tmp_path / "ckpt" / "iter_0000004")).read_metadata().state_dict_metadata
    assert list(metadata["model.embedding.weight"].size) == [vocab_size, 64]
    assert list(metadata["model.output_layer.weight"].size) == [vocab_size, 64]
