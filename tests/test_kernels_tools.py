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
