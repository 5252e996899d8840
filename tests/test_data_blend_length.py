"""How long an unweighted --data-path blend lasts: megafp8 gives Megatron-Core 0.16.1's samples while the request
fits in one epoch of each member, and refuses a longer run before training, naming the flags and the count.

The peer is megatron-core's own ``BlendedMegatronDatasetBuilder`` over the same ``.bin/.idx`` files: for an
unweighted blend (``blend=([A, B], None)``) it builds one epoch of each member and caps the blend at their sum,
so a longer request gets a shorter dataset, on which Megatron-LM's training loop would stop mid-run.
"""
from __future__ import annotations

import argparse
import warnings

import numpy as np
import pytest
import torch

from data_fixtures import write_synthetic_dataset
from megafp8.data.builder import build_train_valid_test_datasets, samples_available
from megafp8.pretrain import main
from megafp8.training.data_setup import build_datasets, training_length_errors
from megafp8.training.megatron_flags import LLAMA_FLAGS

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

SEQ_LENGTH, SPLIT, SEED, GLOBAL_BATCH = 32, "90,8,2", 1234, 8


class _Tokenizer:
    """The few tokenizer attributes Megatron's dataset config reads."""

    vocab_size = 1000
    eod = 1
    unique_identifiers = {"class": "test tokenizer"}


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("blend_length")
    rng = np.random.default_rng(3)
    for seed, (name, count) in enumerate((("a", 120), ("b", 70))):
        write_synthetic_dataset(str(root / name), rng.integers(1, 120, count), seed=seed)
    return [str(root / "a"), str(root / "b")]


def _megatron_train(data_path: list[str], train_samples: int | None):
    config = GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ_LENGTH, blend=get_blend_from_list(data_path), split=SPLIT,
        tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(MegatronGPTDataset, [train_samples, 0, 0], lambda: True, config).build()[0]


def _args(data_path: list[str], train_iters: int | None = None, train_samples: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        data_path=data_path, split=SPLIT, seq_length=SEQ_LENGTH, seed=SEED, global_batch_size=GLOBAL_BATCH,
        train_iters=train_iters, train_samples=train_samples if train_iters is None else train_iters * GLOBAL_BATCH,
        eval_iters=0, eval_interval=1000)


def test_the_blend_gives_one_epoch_of_each_member_as_megatron(prefixes, tmp_path):
    epoch = _megatron_train(prefixes, None)  # Megatron's exhaustive blend: every sample of every member once
    available = samples_available(prefixes, SPLIT, SEQ_LENGTH)[0]
    assert available == len(epoch)
    for request in (available // 3, available):  # within it: Megatron's sample stream, sample by sample
        theirs = _megatron_train(prefixes, request)
        ours = build_train_valid_test_datasets(prefixes, SPLIT, SEQ_LENGTH, SEED, request, 0, 0,
                                               cache_dir=str(tmp_path))[0]
        assert len(ours) == len(theirs) == request
        for i in range(request):
            expected = torch.cat([theirs[i]["tokens"], theirs[i]["labels"][-1:]])
            assert torch.equal(ours[i]["tokens"], expected), f"request {request}, sample {i} differs"
    assert training_length_errors(_args(prefixes, train_samples=available)) == []
    assert training_length_errors(_args(prefixes, train_iters=available // GLOBAL_BATCH)) == []


def test_a_longer_request_megatron_cannot_serve_is_refused_naming_the_flags(prefixes, tmp_path):
    available = len(_megatron_train(prefixes, None))
    train_iters = available // GLOBAL_BATCH + 1
    theirs = _megatron_train(prefixes, train_iters * GLOBAL_BATCH)
    assert len(theirs) == available < train_iters * GLOBAL_BATCH  # capped: Megatron-LM would run out mid-run

    [message] = training_length_errors(_args(prefixes, train_iters=train_iters))
    for part in (f"--train-iters {train_iters}", "--global-batch-size", "--data-path", f"gives: {available} samples",
                 f"at most --train-iters {available // GLOBAL_BATCH}"):
        assert part in message, message
    [message] = training_length_errors(_args(prefixes, train_samples=available + 1))
    assert f"--train-samples {available + 1}" in message and f"at most --train-samples {available}" in message
    with pytest.raises(ValueError, match="--data-path"):  # the training loop's own backstop, same words
        build_datasets(_args(prefixes, train_samples=available + 1))


def test_one_prefix_or_a_weighted_blend_repeats_epochs(prefixes):
    for data_path in ([prefixes[0]], ["0.5", prefixes[0], "0.5", prefixes[1]], ["1", prefixes[0]]):
        assert samples_available(data_path, SPLIT, SEQ_LENGTH) == [None, None, None]
        assert training_length_errors(_args(data_path, train_samples=10 ** 6)) == []


def test_the_training_entry_refuses_before_training_with_one_line(prefixes, capsys):
    available = samples_available(prefixes, SPLIT, SEQ_LENGTH)[0]
    model = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--num-layers", "1",
             "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", str(SEQ_LENGTH),
             "--micro-batch-size", "2", "--global-batch-size", str(GLOBAL_BATCH), "--split", SPLIT, "--data-path",
             *prefixes]
    for length in (["--train-iters", str(available // GLOBAL_BATCH + 1)], ["--train-samples", str(available + 1)]):
        assert main([*model, *length]) == 2
        err = capsys.readouterr().err
        problems = [line for line in err.splitlines() if line.startswith("  - ")]
        assert len(problems) == 1 and length[0] in problems[0] and "--data-path" in problems[0], err
        assert f"gives: {available} samples" in problems[0] and "Traceback" not in err
