"""tools/bench/bench_block_scaled.py without a GPU: it says what the block-scaled GEMM is on each device generation
(native on Blackwell, emulated by a BF16 upcast on Hopper) and refuses to run without CUDA in one line."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "bench"))
import bench_block_scaled  # noqa: E402


def test_mode_names_native_and_emulated_devices():
    assert bench_block_scaled.mode((9, 0)) == "emulated (BF16 upcast)"  # H100 / H200
    assert bench_block_scaled.mode((10, 0)).startswith("native")  # B200
    assert bench_block_scaled.mode((12, 0)).startswith("native")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_a_gpu_it_refuses_in_one_line():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "bench_block_scaled.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].endswith("nothing was run")
