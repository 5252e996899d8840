"""The README's main job, end to end: examples/quickstart.sh builds the corpus, tokenizer and data, trains
TP2 x PP2 x DP2 with sequence parallelism, FP8 delayed scaling and the FP8 ZeRO optimizer in 8 processes,
stops part-way with a checkpoint, resumes, and the loss goes down. (A shorter run than the default 60
iterations; the script is the same.)"""
import json
import os
import subprocess

import pytest

from data_fixtures import REPO_ROOT


def test_quickstart_trains_saves_resumes_and_learns(tmp_path):
    work = tmp_path / "quickstart"
    env = {**os.environ, "QUICKSTART_ITERS": "21"}
    result = subprocess.run(["bash", "examples/quickstart.sh", str(work)], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "loaded checkpoint" in result.stdout and "latest: 21" in result.stdout
    records = [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [5, 10, 15, 20]  # stopped at 14, resumed to 21
    assert train[-1]["lm_loss"] < train[0]["lm_loss"] - 0.5
    assert train[-1]["comm_bytes"]["dp_param_allgather"] > 0 and train[-1]["comm_bytes"]["pp_p2p"] > 0
    assert any("val_lm_loss" in r for r in records)
    assert any((work / "tensorboard").iterdir())


@pytest.mark.slow
def test_full_quickstart_as_the_readme_runs_it(tmp_path):
    """The default 60 iterations (a few minutes on 2 cores): the loss falls by more than 2 nats."""
    work = tmp_path / "quickstart"
    result = subprocess.run(["bash", "examples/quickstart.sh", str(work)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train = [r for r in map(json.loads, (work / "logs" / "metrics.jsonl").read_text().splitlines()) if "lm_loss" in r]
    assert train[-1]["iteration"] == 60 and train[-1]["lm_loss"] < train[0]["lm_loss"] - 2.0
