"""--profile through the training entry as a user launches it: a Chrome trace of exactly the chosen iterations on
exactly the chosen ranks (DP=2 under torchrun, FP8), holding the training ops of those steps; bad --profile flags are
one line each before any process group."""
import json

import pytest

from data_fixtures import small_corpus, sp_model, text_prefix  # noqa: F401 (fixtures)
from test_training_entry import MODEL, _pretrain


@pytest.mark.distributed
def test_profile_writes_a_trace_of_the_window_on_the_chosen_rank(text_prefix, tmp_path):
    prefix, tokenizer = text_prefix
    logs = tmp_path / "logs"
    result = _pretrain(*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--train-iters", "4",
                       "--global-batch-size", "8", "--eval-iters", "0", "--fp8-format", "hybrid",
                       "--fp8-recipe", "delayed", "--use-distributed-optimizer", "--log-dir", str(logs),
                       "--profile", "--profile-step-start", "1", "--profile-step-end", "3", "--profile-ranks", "1",
                       nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    traces = sorted(p.name for p in (logs / "profile").iterdir())
    assert traces == ["rank1.iter2-3.json"]
    events = json.loads((logs / "profile" / traces[0]).read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert "aten::mm" in names or "aten::addmm" in names or "aten::_scaled_mm" in names, sorted(names)[:50]
    assert any("ProfilerStep" in n or n.startswith("aten::") for n in names)
    assert "profile of iterations 2-3 written to" in result.stdout


@pytest.mark.parametrize("flags, message", [
    (["--profile"], "--profile needs --log-dir (or --tensorboard-dir)"),
    (["--profile", "--log-dir", "x", "--profile-step-start", "5", "--profile-step-end", "5"],
     "--profile-step-start 5 and --profile-step-end 5: need 0 <= start < end"),
    (["--profile", "--log-dir", "x", "--profile-ranks", "0", "3"], "--profile-ranks 3: not a rank of this run"),
])
def test_bad_profile_flags_are_one_line_each(text_prefix, flags, message):
    prefix, tokenizer = text_prefix
    result = _pretrain(*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer, "--train-iters", "2", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
