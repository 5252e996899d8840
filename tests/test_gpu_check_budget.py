"""gpu_check.sh fits its six minutes, checked without a GPU: the step budgets add up to <= 360 s, the precompile step's
audit shards cover every case once and the slowest one's compile seconds (measured under Triton 3.6 on this CPU:
tools/bench/audit_shards.py's FAMILY_SECONDS) fit its budget with margin, and every test file and node id the tests
step names exists. A slow test runs one precompile shard on this CPU under the GPU image's Triton (3.6.0)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_CHECK = REPO / "tools" / "bench" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "tools" / "bench"))
import audit_shards  # noqa: E402
import kernel_audit  # noqa: E402

SIX_MINUTES = 360
# The GPU host compiles at about this CPU's speed per core (compile is CPU work) but runs the 8 shards at once on its
# 16 cores; the slowest shard's estimate must leave this share of the budget spare (noise, a slower host, ptxas).
PRECOMPILE_MARGIN = 0.25


def _dry_run(*extra: str) -> dict[str, tuple[int, str]]:
    result = subprocess.run(["bash", str(GPU_CHECK), "--dry-run", *extra], capture_output=True, text=True, cwd=REPO,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    steps = {}
    for line in result.stdout.splitlines():
        head, command = line.split(": ", 1)
        name, budget = head.split(" (")
        steps[name] = (int(budget.removesuffix(" s)")), command)
    return steps


def test_step_budgets_add_up_to_six_minutes():
    steps = _dry_run()
    assert list(steps) == ["precompile", "tests", "gemm", "wgrad", "gluon", "casts", "microscaling", "train"]
    assert all(budget > 0 for budget, _ in steps.values())
    assert sum(budget for budget, _ in steps.values()) <= SIX_MINUTES


def test_train_runs_fit_the_train_budget():
    """bench_train's per-run timeout times its runs stays within the step's budget (a run cut short by the step's
    timeout would lose the rows after it)."""
    budget, command = _dry_run()["train"]
    timeout = float(command.split("--timeout ")[1].split()[0])
    compile_timeout = float(command.split("--compile-timeout ")[1].split()[0])
    names = command.split("--only ")[1].split(" --json")[0].split('" "')
    compiled = sum(name.strip('"').endswith((" + compile", " + cuda graph")) for name in names)
    assert (len(names), compiled) == (6, 3)
    assert (len(names) - compiled) * timeout + compiled * compile_timeout <= budget


def test_precompile_shards_cover_every_case_once_and_fit_the_budget():
    budget, command = _dry_run()["precompile"]
    assert "for i in 0 1 2 3 4 5 6 7;" in command and "--shard $i/8" in command  # all eight, in parallel
    assert " & " in command
    families = kernel_audit.case_families(quick=False)
    plan = audit_shards.shard_plan(families, 8)
    assert len(plan) == len(families) and set(plan) == set(range(8))
    seconds = audit_shards.estimate(families, 8)
    # Balanced: no shard exceeds another by more than the longest single case.
    assert max(seconds) - min(seconds) <= max(audit_shards.FAMILY_SECONDS.values()) + 1e-9
    assert max(seconds) <= (1 - PRECOMPILE_MARGIN) * budget, (seconds, budget)
    # Every family in the audit has a measured cost (a new family must be measured before it is planned).
    assert set(families) <= set(audit_shards.FAMILY_SECONDS)


def test_cpu_precompile_dry_run_is_sequential_and_takes_a_subset():
    steps = _dry_run("--cpu-precompile", "--shards", "2,5")
    assert list(steps) == ["precompile"]
    command = steps["precompile"][1]
    assert "for i in 2 5;" in command and " & " not in command
    bad = subprocess.run(["bash", str(GPU_CHECK), "--cpu-precompile", "--shards", "9"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "'9' is not a shard of 8" in bad.stderr


def test_every_test_the_tests_step_names_exists():
    """Collected, not run: a renamed test would otherwise make the GPU's tests step fail for a reason of no interest."""
    command = _dry_run()["tests"][1]
    ids = command.split('"${xdist[@]}"} ', 1)[1].split()
    assert ids and all(i.startswith("tests/") for i in ids)
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    for test_id in ids:
        assert any(line == test_id or line.startswith(test_id + "::") or line.startswith(test_id + "[")
                   for line in collected), test_id


@pytest.mark.slow
def test_cpu_precompile_runs_a_shard_under_the_gpu_images_triton(tmp_path):
    """--cpu-precompile --shards 0: shard 0 of the precompile step compiled on this CPU under Triton 3.6.0 (side venv),
    passing (no regression), its JSON and one steps.tsv row with the kernels it compiled."""
    if kernel_audit.ptxas_path() is None:
        pytest.skip("the Triton wheel has no ptxas for sm_90a")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OUT"] = str(tmp_path / "out")
    result = subprocess.run(["bash", str(GPU_CHECK), "--cpu-precompile", "--shards", "0"], capture_output=True,
                            text=True, cwd=REPO, env=env, timeout=1500)
    if result.returncode == 3:
        pytest.skip(f"triton==3.6.0 could not be downloaded: {result.stderr.strip().splitlines()[-1:]}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "audit0.json").read_text())
    assert report["triton"] == "3.6.0" and report["shard"] == "0/8" and report["failures"] == []
    plan = audit_shards.shard_plan(kernel_audit.case_families(quick=False), 8)
    assert report["rows"] and plan.count(0) > 0
    name, rc, _, budget, output, compiled = (tmp_path / "out" / "steps.tsv").read_text().strip().split("\t")
    assert (name, rc, output) == ("precompile", "0", "precompile.md") and int(compiled) > 0
    assert int(budget) == _dry_run()["precompile"][0]
    assert "| 0/8 |" in result.stdout  # the shard seconds table
