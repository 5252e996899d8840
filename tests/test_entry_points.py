"""The user-facing entry points run: the pretrain entry's FP8 self-check and the GEMM benchmark's CPU mode."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_pretrain_entry_runs_fp8_self_check():
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", "--fp8-self-check"], capture_output=True,
                            text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    for mode in ("tensorwise", "rowwise", "blockwise", "blockwise_1x128"):
        line = next(l for l in result.stdout.splitlines() if l.strip().startswith(mode + " "))
        assert float(line.split()[1]) >= 25.0, line


def test_bench_gemm_quick_mode(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "tools/bench/bench_gemm.py", "--quick", "--json", str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    names = {r["name"] for r in rows if r["kind"] == "gemm"}
    assert {"megafp8 reference tensorwise", "megafp8 reference rowwise", "megafp8 reference blockwise"} <= names
    quant = {r["name"] for r in rows if r["kind"] == "quantize"}
    assert "cast+transpose block_1x128" in quant and "device copy" in quant
    assert all(r["ms"] > 0 for r in rows)
    assert "| M | N | K | GEMM | ms | TFLOP/s |" in result.stdout


def test_pretrain_entry_without_flags_names_what_is_missing():
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain"], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 2
    assert "--train-iters or --train-samples" in result.stderr and "--data-path" in result.stderr
