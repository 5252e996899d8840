"""The README's main job, end to end and as a new user runs it: its first command, verbatim, in a fresh copy of
the repository with no virtual environment yet. It installs (its own .venv: torch, the package and the extras
that line names), then examples/quickstart.sh builds the corpus, tokenizer and data, trains TP2 x PP2 x DP2 with
sequence parallelism, FP8 delayed scaling and the FP8 ZeRO optimizer in 8 processes, stops part-way with a
checkpoint and resumes. A package the job needs but the install line does not bring fails here."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from data_fixtures import REPO_ROOT as _REPO_ROOT

REPO_ROOT = Path(_REPO_ROOT)


def readme_main_job() -> str:
    """The first bash block of README.md: the 'Run the main job' command."""
    return re.search(r"^```bash\n(.*?)^```", (REPO_ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)[1].strip()


def fresh_copy(destination):
    """The working tree as a clone would have it, uncommitted edits and new files included (tracked plus
    untracked-but-not-ignored files), without .venv, caches or build outputs."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is listed but absent
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def _fresh_shell_env(**extra: str) -> dict[str, str]:
    """This environment minus the test's own virtual environment: `python3` is the machine's, as in a new shell."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                      if not p.startswith(venv))
    return {**env, **extra}


def test_readme_main_job_runs_verbatim_in_a_fresh_venv(tmp_path):
    command = readme_main_job()
    assert command.startswith("python3 -m venv .venv") and "bash examples/quickstart.sh" in command
    repo = fresh_copy(tmp_path / "megafp8")
    assert not (repo / ".venv").exists()
    # 9 iterations: the first run stops (and saves) at 6, logs iteration 5; the resumed run ends at 9.
    result = subprocess.run(["bash", "-c", command], cwd=repo, env=_fresh_shell_env(QUICKSTART_ITERS="9"),
                            capture_output=True, text=True, timeout=3000)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    assert (repo / ".venv" / "bin" / "python").exists()
    assert "Traceback" not in result.stderr, output
    assert result.stdout.count("loaded checkpoint") == 1 and "latest: 9" in result.stdout, output
    assert "megafp8: trained 9 iterations" in result.stdout and "megafp8: layout TP 2 x CP 1 x PP 2 x DP 2" in result.stdout
    work = repo / "runs" / "quickstart"
    records = [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [5] and 0 < train[0]["lm_loss"] < 9.0  # ln(4000) = 8.3 at the start
    assert train[0]["comm_bytes"]["dp_param_allgather"] > 0 and train[0]["comm_bytes"]["pp_p2p"] > 0
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
