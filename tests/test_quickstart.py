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
    # 21 iterations: the first run stops (and saves) at 14; the resumed run evaluates and saves at 20, ends at 21.
    result = subprocess.run(["bash", "-c", command], cwd=repo, env=_fresh_shell_env(QUICKSTART_ITERS="21"),
                            capture_output=True, text=True, timeout=3000)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    assert (repo / ".venv" / "bin" / "python").exists()
    assert "Traceback" not in result.stderr, output
    assert result.stdout.count("loaded checkpoint") == 1 and "latest: 21" in result.stdout, output
    assert "megafp8: trained 21 iterations" in result.stdout and "megafp8: layout TP 2 x CP 1 x PP 2 x DP 2" in result.stdout
    work = repo / "runs" / "quickstart"
    records = [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [5, 10, 15, 20]  # stopped at 14, resumed to 21
    assert train[-1]["lm_loss"] < train[0]["lm_loss"] - 0.5
    assert train[-1]["comm_bytes"]["dp_param_allgather"] > 0 and train[-1]["comm_bytes"]["pp_p2p"] > 0
    assert any((work / "tensorboard").iterdir())
    # The checkpoint exported to HF reproduces the validation loss the run logged at iteration 20 (transformers,
    # fp32, on the same validation samples; the run itself evaluated in FP8).
    (logged,) = [r["val_lm_loss"] for r in records if "val_lm_loss" in r]
    assert _hf_validation_loss(repo, work / "checkpoints", 20, tmp_path / "hf") == pytest.approx(logged, rel=1e-4)


def _hf_validation_loss(run_dir: Path, checkpoints: Path, iteration: int, hf_dir: Path) -> float:
    """transformers' mean token loss, on the run's first --eval-iters validation batches (rebuilt from the flags
    the checkpoint recorded; its relative --data-path from ``run_dir``), of the HF export of ``iteration``."""
    import argparse

    import torch
    import torch.nn.functional as F
    transformers = pytest.importorskip("transformers")
    from convert_testing import convert
    from megafp8.parallel.parallel_state import ParallelState
    from megafp8.training.data_setup import batches, build_datasets

    converted = convert("--load-format", "megafp8", "--save-format", "hf", "--save-dtype", "fp32", "--load-dir",
                        checkpoints, "--load-iteration", iteration, "--save-dir", hf_dir)
    assert converted.returncode == 0, converted.stderr
    manifest = json.loads((checkpoints / f"iter_{iteration:07d}" / "megafp8_checkpoint.json").read_text())
    args = argparse.Namespace(**manifest["args"])
    args.data_path = [str(run_dir / prefix) for prefix in args.data_path]  # the quickstart's is one relative prefix
    _, valid = build_datasets(args)
    stream = batches(valid, 0, args, ParallelState().init_process_groups())  # one DP rank: the whole batches
    tokens = torch.cat([next(stream) for _ in range(args.eval_iters * args.global_batch_size // args.micro_batch_size)])
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), tokens[:, 1:].reshape(-1)).item()


@pytest.mark.slow
def test_full_quickstart_as_the_readme_runs_it(tmp_path):
    """The default 60 iterations (a few minutes on 2 cores): the loss falls by more than 2 nats."""
    work = tmp_path / "quickstart"
    result = subprocess.run(["bash", "examples/quickstart.sh", str(work)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train = [r for r in map(json.loads, (work / "logs" / "metrics.jsonl").read_text().splitlines()) if "lm_loss" in r]
    assert train[-1]["iteration"] == 60 and train[-1]["lm_loss"] < train[0]["lm_loss"] - 2.0
