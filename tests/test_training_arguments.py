"""The training entry's flags: Megatron names parse into the fields the stack reads, and every bad
combination is reported before any process-group work, naming its flag."""
import pytest

from megafp8.fp8 import Fp8Recipe
from megafp8.training.arguments import ArgumentError, parse_args
from megafp8.training.megatron_flags import LLAMA_FLAGS

BASE = [*LLAMA_FLAGS, "--data-path", "data/x_text_document", "--tokenizer-model", "tok.model", "--train-iters", "10"]


def test_megatron_flags_parse_and_derive():
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--sequence-parallel", "--micro-batch-size", "2", "--global-batch-size", "16",
                              "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
                              "--use-distributed-optimizer", "--fp8-param-gather", "--hidden-size", "96"],
                      world_size=8)
    assert args.data_parallel_size == 2 and args.num_micro_batches == 4 and args.train_samples == 160
    assert args.pipeline_schedule == "1f1b" and args.ffn_hidden_size == 256  # 8/3 x 96, a multiple of 64
    recipe = Fp8Recipe.from_args(args)
    assert recipe.scaling == "delayed" and recipe.amax_history_len == 16 and recipe.fp8_format == "hybrid"


def test_fp32_is_the_default_precision_and_vpp_selects_interleaved():
    args = parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                              "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "2"],
                      world_size=2)
    assert not args.bf16 and args.fp8_format is None and Fp8Recipe.from_args(args) is None
    assert args.pipeline_schedule == "interleaved"


@pytest.mark.parametrize("extra, world, flag", [
    (["--tensor-model-parallel-size", "3"], 4, "--tensor-model-parallel-size (3)"),
    (["--global-batch-size", "3", "--micro-batch-size", "2"], 1, "--global-batch-size (3)"),
    (["--train-samples", "7"], 1, "--train-iters and --train-samples are exclusive"),
    (["--fp8-param-gather", "--fp8-format", "hybrid"], 1, "--fp8-param-gather needs --use-distributed-optimizer"),
    (["--train-iters", "0"], 1, "--train-iters must be positive, got 0"),
    (["--lr=-1e-3"], 1, "--lr must not be negative, got -0.001"),
    (["--min-lr", "1e-2", "--lr", "1e-3"], 1, "--min-lr (0.01) must be within [0, --lr (0.001)]"),
    (["--lr-warmup-iters", "10"], 1, "the LR warm-up (10 samples, --lr-warmup-iters/-samples) must be shorter"),
    (["--allow-changed-args", "lr", "--load", "ckpt"] + ["--allow-changed-args", "nope"], 1, "--allow-changed-args nope: not a flag"),
    (["--allow-changed-args", "lr"], 1, "--allow-changed-args needs --load"),
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
        parse_args([*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--pipeline-schedule", "zbv"], world_size=1)
    message = str(info.value)
    for flag in ("--train-iters or --train-samples", "--vocab-size", "--data-path", "--pipeline-schedule zbv"):
        assert flag in message


def test_layout_and_model_problems_come_with_the_flag_problems():
    """One process at TP 3 with 4 heads: the world size AND the head divisibility, and the flag errors too."""
    with pytest.raises(ArgumentError) as info:
        parse_args(BASE + ["--tensor-model-parallel-size", "3", "--num-attention-heads", "4", "--lr=-1",
                           "--train-iters", "0"], world_size=1)
    message = str(info.value)
    for problem in ("does not divide the world size (1)", "--num-attention-heads (4) must be divisible by "
                    "--tensor-model-parallel-size (3)", "--lr must not be negative", "--train-iters must be positive"):
        assert problem in message


def test_sequence_parallel_at_tp1_is_turned_off_with_one_warning():
    """Megatron-LM's validate_args: 'Disabling sequence parallelism because tensor model parallelism is disabled'."""
    warnings = []
    args = parse_args(BASE + ["--sequence-parallel"], world_size=2, warn=warnings.append)
    assert args.sequence_parallel is False and args.data_parallel_size == 2
    assert warnings == ["--sequence-parallel turned off: it needs --tensor-model-parallel-size > 1 "
                        "(Megatron-LM does the same)"]
    args = parse_args(BASE + ["--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=2,
                      warn=warnings.append)
    assert args.sequence_parallel is True and len(warnings) == 1


def test_a_flag_whose_package_is_missing_is_one_line(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real_find_spec(name, *a))
    with pytest.raises(ArgumentError) as info:
        parse_args(BASE + ["--tensorboard-dir", "tb"])
    assert "--tensorboard-dir needs the tensorboard package, which is not installed: pip install tensorboard" in str(info.value)


def test_help_has_one_line_per_flag_and_no_backwards_switch_default(capsys):
    from megafp8.training.arguments import build_parser

    parser = build_parser()
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--no-fp8-saturation-guard turn the saturation guard off" in text
    assert "pass is saved (default: True)" not in text and "(default: False)" not in text
    assert "(default: delayed)" in text and "(default: 0.0)" in text  # values, zeros included
    assert "--fp8-self-check" in text


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(BASE + ["--fp8-wgrad"])
    assert info.value.code == 2 and "--fp8-wgrad" in capsys.readouterr().err


def test_wsd_schedule_flags_reach_the_schedule():
    from megafp8.training.schedules import learning_rate_schedule

    args = parse_args(BASE + ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4", "--lr-wsd-decay-style", "linear",
                              "--lr", "1e-3", "--min-lr", "1e-4"])
    schedule = learning_rate_schedule(args)
    # decay over 10 samples (global batch 1), annealing over the last 4: held until 6, then linear to --min-lr
    assert schedule(6) == 1e-3 and schedule(7) == pytest.approx(1e-3 - 0.25 * 9e-4) and schedule(10) == pytest.approx(1e-4)
    with pytest.raises(ArgumentError, match="--lr-wsd-decay-iters"):
        parse_args(BASE + ["--lr-decay-style", "WSD"])
