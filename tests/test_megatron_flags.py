"""Megatron-LM's launch scripts run unchanged through megafp8.pretrain: every flag is Megatron-LM's (meaning and
default, checked against a snapshot of Megatron-LM's own parser) or listed as megafp8's; the Llama-3 FP8 script
parses in both variants and, scaled down, trains with --mock-data; the GPT-3 script is refused with every reason.

The fixtures (tests/fixtures/megatron_lm/) are Megatron-LM's parser and scripts at the commit named in parser.json,
written by tools/megatron_parser_fixture.py. The scripts run verbatim under bash with a `torchrun` that records
its argv, so what reaches megafp8 is exactly what Megatron-LM's pretrain_gpt.py would have got.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from convert_testing import checkpoint_tensors
from megafp8.training.arguments import build_parser, parse_and_check
from megafp8.training.megatron_flags import DEFAULTS_THAT_DIFFER, MEGAFP8_ONLY, REFUSED_FLAGS, REFUSED_VALUES

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "megatron_lm"
MEGATRON = json.loads((FIXTURES / "parser.json").read_text())["flags"]
LLAMA_SCRIPT = FIXTURES / "train_llama3_8b_h100_fp8.sh"
GPT3_SCRIPT = FIXTURES / "train_gpt3_175b_distributed.sh"


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _our_flags() -> dict[str, object]:
    return {a.option_strings[0]: a for a in build_parser()._actions if a.dest != "help"}


def script_argv(script: Path, tmp_path: Path, *script_args: str) -> list[str]:
    """The flags the script hands pretrain_gpt.py, from running it verbatim with a recording `torchrun`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    torchrun = bin_dir / "torchrun"
    torchrun.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
    torchrun.chmod(0o755)
    (tmp_path / "pretrain_gpt.py").touch()  # the Llama script checks it is run from Megatron-LM's root
    out = tmp_path / "argv.bin"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGV_OUT": str(out)}
    subprocess.run(["bash", str(script), *script_args], cwd=tmp_path, env=env, check=True, capture_output=True,
                   timeout=60)
    argv = out.read_bytes().decode().split("\0")[:-1]
    return argv[argv.index("pretrain_gpt.py") + 1:]


def _replace(argv: list[str], values: dict[str, str]) -> list[str]:
    """argv with each flag's value replaced (the scale-down), every other flag left as the script wrote it."""
    argv = list(argv)
    for flag, value in values.items():
        argv[argv.index(flag) + 1] = value
    return argv


def test_every_flag_is_megatrons_or_listed_as_megafp8s():
    ours = _our_flags()
    not_megatron = sorted(f for f in ours if f not in MEGATRON and f not in MEGAFP8_ONLY)
    assert not not_megatron, f"flags neither Megatron-LM's nor in MEGAFP8_ONLY: {not_megatron}"
    wrongly_listed = sorted(f for f in MEGAFP8_ONLY if f in MEGATRON or f not in ours)
    assert not wrongly_listed, f"MEGAFP8_ONLY lists Megatron-LM's flags or unknown ones: {wrongly_listed}"
    for flag in [*REFUSED_FLAGS, *REFUSED_VALUES]:
        assert flag in MEGATRON and flag in ours, flag


def test_shared_flags_have_megatrons_defaults_and_switch_kind():
    ours = _our_flags()
    differ = {}
    for flag, action in ours.items():
        if flag not in MEGATRON:
            continue
        theirs = MEGATRON[flag]
        # A Megatron switch must work bare here too (megafp8's --first-last-layers-bf16 takes an optional N).
        assert (action.nargs in (0, "?")) if theirs["nargs"] == 0 else action.nargs not in (0, "?"), flag
        if _plain(action.default) != theirs["default"]:
            differ[flag] = (action.default, theirs["default"])
    unexplained = sorted(set(differ) - set(DEFAULTS_THAT_DIFFER))
    assert not unexplained, {f: differ[f] for f in unexplained}
    stale = sorted(set(DEFAULTS_THAT_DIFFER) - set(differ))
    assert not stale, f"DEFAULTS_THAT_DIFFER names flags whose defaults agree: {stale}"
    # The math defaults a Megatron script may leave out (the GPT-3 example leaves most out).
    for flag in ("--adam-beta2", "--lr-decay-style", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
                 "--attention-dropout", "--hidden-dropout", "--normalization", "--position-embedding-type"):
        assert flag not in DEFAULTS_THAT_DIFFER


@pytest.mark.parametrize("variant", ["mock", "real"])
def test_llama3_fp8_script_parses_with_no_unknown_flag(tmp_path, variant):
    script_args = ["ckpt", "tb"] + (["MOCK", "MOCK"] if variant == "mock" else ["/models/llama3", "/data/corpus"])
    argv = script_argv(LLAMA_SCRIPT, tmp_path, *script_args)
    assert "--apply-layernorm-1p" in argv and "--calculate-per-token-loss" in argv  # the script, not a stub
    args, errors, warnings = parse_and_check(argv, world_size=8)  # argparse exits on an unknown flag
    assert errors == []
    assert warnings == ["--sequence-parallel turned off: it needs --tensor-model-parallel-size > 1 (Megatron-LM does "
                        "the same)"]
    assert (args.kv_channels, args.num_query_groups, args.ffn_hidden_size, args.activation) == (128, 8, 14336, "swiglu")
    assert args.layernorm_zero_centered_gamma and args.calculate_per_token_loss and args.decoupled_lr == 5e-4
    assert (args.attention_dropout, args.hidden_dropout, args.data_parallel_size) == (0.0, 0.0, 8)
    assert args.mock_data == (variant == "mock")


def test_llama3_fp8_script_scaled_down_trains_with_mock_data(tmp_path):
    argv = script_argv(LLAMA_SCRIPT, tmp_path, str(tmp_path / "ckpt"), str(tmp_path / "tb"), "MOCK", "MOCK")
    argv = _replace(argv, {
        "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
        "--num-query-groups": "2", "--kv-channels": "32", "--seq-length": "32", "--max-position-embeddings": "32",
        "--global-batch-size": "4", "--train-samples": "12", "--lr-decay-samples": "12", "--lr-warmup-samples": "4",
        "--vocab-size": "512", "--eval-iters": "1", "--eval-interval": "2", "--save-interval": "2",
        "--profile-step-start": "1", "--profile-step-end": "2"})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *argv], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    log = result.stdout
    assert re.search(r"^ iteration +3/ +3 \| consumed samples: +12 \|.* lm loss: \d\.\d+E[+-]\d+ \|", log, re.MULTILINE), log
    assert " validation loss at iteration 2 | lm loss: " in log
    weights = checkpoint_tensors(tmp_path / "ckpt")  # the model the script describes: d = --kv-channels, 1p gains
    assert weights["model.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 32, 64)
    assert weights["model.final_layernorm.weight"].abs().max() < 0.1
    assert list((tmp_path / "benchmark_cache_llama3_8b_fp8").iterdir()), "--data-cache-path holds the index cache"


def test_gpt3_script_is_refused_with_every_reason_at_once(tmp_path):
    argv = script_argv(GPT3_SCRIPT, tmp_path, "ckpt", "tb", "vocab.json", "merges.txt", "data_text_document")
    _, errors, _ = parse_and_check(argv, world_size=8 * 16)
    text = "\n".join(errors)
    for reason in ("--normalization LayerNorm", "--position-embedding-type learned_absolute", "no --swiglu",
                   "no --disable-bias-linear", "--step-batch-size-schedule:"):
        assert reason in text, (reason, text)
    # Through the entry: one message, exit status 2, nothing trained.
    env = {**os.environ, "WORLD_SIZE": "1"}
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *argv], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={k: v for k, v in env.items() if k != "WORLD_SIZE"})
    assert result.returncode == 2
    assert result.stderr.count("megafp8-pretrain: error: invalid arguments") == 1
    assert "GeLU MLP" in result.stderr and "RMSNorm only" in result.stderr


def test_a_megatron_default_left_out_is_megatrons_not_megafp8s():
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-iters", "2",
            "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear"]
    args, errors, _ = parse_and_check(base)
    assert errors == []
    assert (args.attention_dropout, args.hidden_dropout, args.adam_beta2, args.lr_decay_style) == (0.1, 0.1, 0.999,
                                                                                                    "linear")
    assert (args.num_query_groups, args.ffn_hidden_size) == (args.num_attention_heads, 128)  # int(4*64*2/3/64)*64
    _, errors, _ = parse_and_check(base + ["--num-query-groups", "2"])
    assert errors == ["--num-query-groups 2 without --group-query-attention: Megatron-LM ignores it and builds "
                      "multi-head attention; add --group-query-attention"]
    args, errors, _ = parse_and_check(base + ["--group-query-attention"])
    assert errors == [] and args.num_query_groups == 1  # Megatron-LM's default with the switch


def test_docs_list_every_flag_in_three_groups():
    sys.path.insert(0, str(REPO / "tools"))
    from print_flags import megatron_groups

    text = (REPO / "docs" / "training.md").read_text()
    marker = "<!-- generated by `python tools/print_flags.py --megatron`"
    assert text[text.index(marker):].split("\n", 1)[1].startswith(megatron_groups() + "\n### "), (
        "docs/training.md's Megatron-LM flag tables are stale: paste the output of python tools/print_flags.py "
        "--megatron")
