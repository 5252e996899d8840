"""The GPU check scripts on a machine without a GPU: usage on --help, a clear stop (no work) otherwise."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GPU_CHECK = REPO / "tools" / "bench" / "gpu_check.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, cwd=REPO, timeout=120)


def test_gpu_check_help_prints_usage_and_exits_0(tmp_path):
    for flag in ("--help", "-h"):
        result = _run("bash", str(GPU_CHECK), flag)
        assert result.returncode == 0 and result.stdout.startswith("usage: bash tools/bench/gpu_check.sh")
        assert "n_spills" in result.stdout and "6 minutes" in result.stdout
    result = _run("bash", str(GPU_CHECK), "--bogus")
    assert result.returncode == 2 and "unknown argument '--bogus'" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_without_gpu_stops_before_running_anything(tmp_path):
    result = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)})
    assert result.returncode == 1
    assert "nothing was run" in result.stderr and ("no NVIDIA GPU" in result.stderr or "no CUDA" in result.stderr)
    assert not (tmp_path / "out").exists(), "no step may start (not even the output folder)"
    resources = _run(sys.executable, "tools/bench/kernel_resources.py")
    assert resources.returncode == 2 and "no CUDA GPU" in resources.stderr


def test_gpu_check_arguments_and_dry_run_without_gpu():
    result = _run("bash", str(GPU_CHECK), "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["precompile", "tests", "gemm", "wgrad", "gluon", "casts",
                                                        "microscaling", "train"]
    budgets = [int(line.split("(")[1].split(" s)")[0]) for line in lines]
    assert sum(budgets) <= 360  # the six-minute budget
    train = lines[-1]
    for name in ("high precision (bf16)", "fp8 delayed", "fp8 blockwise", "high precision (bf16) + compile",
                 "fp8 delayed + compile", "fp8 delayed + cuda graph"):
        assert f'"{name}"' in train  # bf16 against FP8, eager, compiled and CUDA-graphed, by exact name
    one = _run("bash", str(GPU_CHECK), "--dry-run", "--steps", "train,gemm")
    assert [line.split(" ")[0] for line in one.stdout.splitlines()] == ["train", "gemm"]
    bad = _run("bash", str(GPU_CHECK), "--steps", "train,bogus")
    assert bad.returncode == 2 and "unknown step 'bogus'" in bad.stderr
    missing = _run("bash", str(GPU_CHECK), "--steps")
    assert missing.returncode == 2 and "--steps needs a value" in missing.stderr


@pytest.mark.slow  # ~90 s of CPU GEMMs; tests/test_entry_points.py runs bench_gemm --quick in the default suite
def test_bench_gemm_launch_and_table_arguments():
    bad = _run(sys.executable, "tools/bench/bench_gemm.py", "--quantize-only", "--quantize-launch", "3,32,16,4")
    assert bad.returncode == 2 and "'3,32,16,4': expected TILES,SLAB,SLAB_TRANSPOSED,WARPS" in bad.stderr
    both = _run(sys.executable, "tools/bench/bench_gemm.py", "--gemm-only", "--quantize-only")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    cpu = _run(sys.executable, "tools/bench/bench_gemm.py", "--quick", "--quantize-only", "--quantize-launch", "1,32,16,4")
    assert cpu.returncode == 2 and "it needs a CUDA GPU" in cpu.stderr
    quantize = _run(sys.executable, "tools/bench/bench_gemm.py", "--quick", "--quantize-only")
    assert quantize.returncode == 0, quantize.stderr
    assert "| quantize tensorwise |" in quantize.stdout and "torch.matmul" not in quantize.stdout
    gemm = _run(sys.executable, "tools/bench/bench_gemm.py", "--quick", "--gemm-only")
    assert gemm.returncode == 0 and "torch.matmul" in gemm.stdout and "quantize tensorwise" not in gemm.stdout


def test_bench_train_only_takes_exact_names():
    listed = _run(sys.executable, "tools/bench/bench_train.py", "--list")
    assert listed.returncode == 0 and "fp8 delayed" in listed.stdout.splitlines()
    result = _run(sys.executable, "tools/bench/bench_train.py", "--quick", "--only", "fp8 delay")
    assert result.returncode == 2 and "--only 'fp8 delay': not a configuration" in result.stderr


def test_gpu_check_table_writer(tmp_path):
    (tmp_path / "steps.tsv").write_text("precompile\t0\t41\t60\tprecompile.md\ntrain\t124\t150\t150\ttrain.md\n"
                                        "gemm\t1\t3\t60\tgemm.md\n")
    (tmp_path / "train.md").write_text("log line\n| run | tokens/s |\n|---|---|\n| fp8 delayed | 123.0 |\n")
    result = _run(sys.executable, "tools/bench/gpu_check_table.py", str(tmp_path))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "summary.md").read_text()
    assert text == result.stdout
    rows = text.splitlines()
    assert rows[2] == "| precompile | passed | 41 | 60 | precompile.md |"
    assert rows[3] == "| train | timed out | 150 | 150 | train.md |"
    assert rows[4] == "| gemm | failed (exit 1) | 3 | 60 | gemm.md |"
    assert rows[5] == "| total | 1/3 passed | 194 | 270 | |"
    assert "### train" in text and "| fp8 delayed | 123.0 |" in text and "log line" not in text
    usage = _run(sys.executable, "tools/bench/gpu_check_table.py", str(tmp_path / "nowhere"))
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_bench_train_table_keeps_failed_runs():
    sys.path.insert(0, str(REPO / "tools" / "bench"))
    import bench_train

    ok = {"name": "fp8 delayed", "tokens_per_s": 10.0, "tflops": 1.0, "mfu_bf16": None, "mfu_fp8": None,
          "peak_memory_bytes": 2**30, "peak_memory_kind": "cuda_max_allocated", "model_state_bytes_per_param": 8.0,
          "final_lm_loss": 6.9}
    table = bench_train.markdown([{"name": "high precision (bf16)", "error": "exit 1"}, ok]).splitlines()
    assert table[2].startswith("| high precision (bf16) | failed: exit 1 |")
    assert table[3].startswith("| fp8 delayed | 10.0 | n/a | 1.0000 |")


def test_gpu_check_tests_step_installs_nothing_and_skips_without_pytest(tmp_path):
    """The GPU image may lack pytest: the step says so and passes instead of failing or installing it."""
    import os

    command = next(line.split(": ", 1)[1] for line in _run("bash", str(GPU_CHECK), "--dry-run").stdout.splitlines()
                   if line.startswith("tests ("))
    assert "pip" not in command
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/usr/bin/env bash\nfor a in "$@"; do [ "$a" = "import pytest" ] && exit 1; '
                                     f'done\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert result.returncode == 0 and "tests: SKIPPED: pytest is not installed" in result.stdout, result.stdout
