"""gpu_check_table.py's kernels-compiled column (gpu_check.sh counts each step's new cubins in the Triton cache) and its
--shard-seconds table of the precompile step's audit shards (kernel_audit.py --json)."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _table(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/bench/gpu_check_table.py", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_kernels_compiled_column_and_total(tmp_path):
    (tmp_path / "steps.tsv").write_text("precompile\t0\t41\t60\tprecompile.md\t240\ntrain\t0\t90\t110\ttrain.md\t0\n"
                                        "tests\t124\t75\t75\ttests.md\t31\n")
    result = _table(str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = (tmp_path / "summary.md").read_text().splitlines()
    assert rows[0] == "| step | result | seconds | budget s | output | kernels compiled |"
    assert rows[2] == "| precompile | passed | 41 | 60 | precompile.md | 240 |"
    assert rows[3] == "| train | passed | 90 | 110 | train.md | 0 |"
    assert rows[4] == "| tests | timed out | 75 | 75 | tests.md | 31 |"
    assert rows[5] == "| total | 2/3 passed | 206 | 245 | | 271 |"


def test_shard_seconds_table(tmp_path):
    (tmp_path / "steps.tsv").write_text("precompile\t0\t50\t60\tprecompile.md\t66\n")
    for shard, (wall, cpu, known) in enumerate(((53.6, 30.6, []), (121.0, 36.0, ["a", "b", "c"]))):
        (tmp_path / f"audit{shard}.json").write_text(json.dumps({
            "shard": f"{shard}/8", "rows": [{}] * (36 - shard), "failures": [], "known_spills": known,
            "wall_seconds": wall, "cpu_seconds": cpu}))
    result = _table("--shard-seconds", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "| shard | rows | failures | known spills | wall seconds | CPU seconds |"
    assert lines[2:] == ["| 0/8 | 36 | 0 | 0 | 53.6 | 30.6 |", "| 1/8 | 35 | 0 | 3 | 121.0 | 36.0 |"]
    assert _table("--shard-seconds", str(tmp_path / "nowhere")).returncode == 2
