"""tools/fp8_report.py --pair RUN=REFERENCE: the paired-runs table (final-loss gap and the largest per-iteration
gap against a run differing in one flag, e.g. --fp8-grad-reduce on/off) and a one-line error for a bad pair."""
import json
import os
import subprocess
import sys

from data_fixtures import REPO_ROOT


def _write_run(path, loss_scale: float) -> None:
    path.mkdir(parents=True)
    lines = [json.dumps({"iteration": it, "lm_loss": loss_scale * (8 - 0.1 * it), "grad_norm": 1.0})
             for it in range(1, 11)]
    lines.append(json.dumps({"iteration": 10, "val_lm_loss": 7.0 * loss_scale}))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _report(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "fp8_report.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_pair_table_and_bad_pair(tmp_path):
    _write_run(tmp_path / "zero", 1.0)
    _write_run(tmp_path / "fp8_reduce", 1.002)  # +0.2% everywhere
    _write_run(tmp_path / "far", 1.01)
    runs = [tmp_path / "zero", tmp_path / "fp8_reduce", tmp_path / "far"]
    result = _report(*runs, "--output", tmp_path / "report", "--pair", "fp8_reduce=zero", "--pair", "far=zero")
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| fp8_reduce | zero | +0.200% | 0.200% | within the 0.5% band |" in report
    assert "| far | zero | +1.000% | 1.000% | OUTSIDE the 0.5% band |" in report
    bad = _report(*runs, "--output", tmp_path / "r2", "--pair", "fp8_reduce=nope")
    assert bad.returncode == 2 and "--pair fp8_reduce=nope: nope is not one of the runs" in bad.stderr
    assert "Traceback" not in bad.stderr
