"""The training entry's flags: Megatron names parse into the fields the stack reads, and every bad
combination is reported before any process-group work, naming its flag."""
import pytest

from megafp8.fp8 import Fp8Recipe
from megafp8.training.arguments import ArgumentError, parse_args

BASE = ["--data-path", "data/x_text_document", "--tokenizer-model", "tok.model", "--train-iters", "10"]


def test_megatron_flags_parse_and_derive():
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--sequence-parallel", "--micro-batch-size", "2", "--global-batch-size", "16",
                              "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
                              "--use-distributed-optimizer", "--fp8-param-gather", "--hidden-size", "96"],
                      world_size=8)
    assert args.data_parallel_size == 2 and args.num_micro_batches == 4 and args.train_samples == 160
    assert args.pipeline_schedule == "1f1b" and args.ffn_hidden_size == 256  # 8/3 x 96 rounded up to 64
    recipe = Fp8Recipe.from_args(args)
    assert recipe.scaling == "delayed" and recipe.amax_history_len == 16 and recipe.fp8_format == "hybrid"


def test_fp32_is_the_default_precision_and_vpp_selects_interleaved():
    args = parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                              "--num-layers-per-virtual-pipeline-stage", "1"], world_size=2)
    assert not args.bf16 and args.fp8_format is None and Fp8Recipe.from_args(args) is None
    assert args.pipeline_schedule == "interleaved"


@pytest.mark.parametrize("extra, world, flag", [
    (["--tensor-model-parallel-size", "3"], 4, "--tensor-model-parallel-size (3)"),
    (["--global-batch-size", "3", "--micro-batch-size", "2"], 1, "--global-batch-size (3)"),
    (["--train-samples", "7"], 1, "--train-iters and --train-samples are exclusive"),
    (["--fp8-param-gather", "--fp8-format", "hybrid"], 1, "--fp8-param-gather needs --use-distributed-optimizer"),
    (["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--pipeline-schedule", "zbv"], 1, "--pipeline-schedule zbv needs --pipeline-model-parallel-size > 1"),
    (["--recompute-granularity", "full"], 1, "--recompute-granularity full needs --recompute-method"),
    (["--optimizer-state-dtype", "fp8"], 1, "need --use-distributed-optimizer"),
    (["--finetune"], 1, "--finetune needs --load"),
    (["--micro-batch-size", "0"], 1, "--micro-batch-size must be positive"),
])
def test_bad_flags_name_the_flag(extra, world, flag):
    with pytest.raises(ArgumentError, match=__import__("re").escape(flag)):
        parse_args(BASE + extra, world_size=world)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ArgumentError) as info:
        parse_args(["--tokenizer-type", "NullTokenizer", "--sequence-parallel"], world_size=1)
    message = str(info.value)
    for flag in ("--train-iters or --train-samples", "--vocab-size", "--data-path", "--sequence-parallel"):
        assert flag in message


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(BASE + ["--fp8-wgrad"])
    assert info.value.code == 2 and "--fp8-wgrad" in capsys.readouterr().err


def test_wsd_schedule_flags_reach_the_schedule():
    from megafp8.training.train import learning_rate_schedule

    args = parse_args(BASE + ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4", "--lr-wsd-decay-style", "linear",
                              "--lr", "1e-3", "--min-lr", "1e-4"])
    schedule = learning_rate_schedule(args)
    # decay over 10 samples (global batch 1), annealing over the last 4: held until 6, then linear to --min-lr
    assert schedule(6) == 1e-3 and schedule(7) == pytest.approx(1e-3 - 0.25 * 9e-4) and schedule(10) == pytest.approx(1e-4)
    with pytest.raises(ArgumentError, match="--lr-wsd-decay-iters"):
        parse_args(BASE + ["--lr-decay-style", "WSD"])
