"""The offline sm_100a audit (tools/bench/kernel_audit_blackwell.py --quick): the block-scaled GEMM compiles for
Blackwell to the native block-scaled tensor-core MMA (tcgen05.mma ... block_scale in PTX, a UTC*MMA with its two
scale operands in tensor memory in SASS) for MXFP8, MXFP4 and NVFP4, every microscaling quantize kernel compiles,
and nothing spills; on sm_90a the same GEMM is an upcast to bf16 wgmma (Hopper runs these recipes emulated).
Skipped only when the Triton wheel has no ptxas that takes sm_100a."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO_ROOT / "tools" / "bench"))
import kernel_audit_blackwell  # noqa: E402

# The MMA kind each pair must compile to on sm_100a.
KINDS = {"mxfp8": "kind::mxf8f6f4.block_scale.block32", "mxfp4": "kind::mxf4.block_scale.block32",
         "nvfp4": "kind::mxf4nvf4.block_scale.block16"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if kernel_audit_blackwell.ptxas_path() is None:
        pytest.skip("the Triton wheel has no ptxas that takes sm_100a: the Blackwell audit cannot run")
    scratch = tmp_path_factory.mktemp("audit_blackwell")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile real kernels
    env.update(TRITON_CACHE_DIR=str(scratch / "cache"), TRITON_DEFAULT_FP_FUSION="1")  # nothing cached across runs
    result = subprocess.run([sys.executable, "tools/bench/kernel_audit_blackwell.py", "--quick", "--json",
                             str(scratch / "a.json")], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=1200)
    assert (scratch / "a.json").exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads((scratch / "a.json").read_text())


def test_everything_compiles_without_spills(report):
    result, data = report
    for row in data["rows"]:
        assert "error" not in row, row
        assert row["registers"] <= 255 and row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0, row
    assert data["failures"] == [] and result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| block_scaled_gemm | sm_100a | 128x128x128 w4 s4 |" in result.stdout  # the table docs/kernels.md shows


def test_blackwell_gemm_uses_the_block_scaled_mma(report):
    _, data = report
    gemms = [r for r in data["rows"] if r["kernel"] == "block_scaled_gemm" and r["target"] == "sm_100a"]
    assert {r["case"].split()[0] for r in gemms} == set(KINDS)
    assert len(gemms) == 2 * len(kernel_audit_blackwell.GEMM_PAIRS)  # both shapes of every pair
    for r in gemms:
        kind = KINDS[r["case"].split()[0]]
        assert r["ptx_block_scaled"] and any(kind in mma for mma in r["ptx_mma"]), r
        assert r["sass_block_scaled"], r  # accumulator, A scales and B scales in tensor memory
        assert r["tmem_columns"] > 0, r  # the accumulator lives in tensor memory


def test_hopper_gemm_is_a_bf16_upcast(report):
    """docs/kernels.md: on sm_90a Triton upcasts dot_scaled to bf16 (wgmma bf16, no block-scaled MMA)."""
    _, data = report
    hopper = [r for r in data["rows"] if r["kernel"] == "block_scaled_gemm" and r["target"] == "sm_90a"]
    assert len(hopper) == 2 * len(kernel_audit_blackwell.GEMM_PAIRS)
    for r in hopper:
        assert not r["ptx_block_scaled"] and r["ptx_mma"], r
        assert all("bf16" in mma and mma.startswith("wgmma") for mma in r["ptx_mma"]), r


def test_every_quantize_specialization_is_audited(report):
    _, data = report
    casts = {r["case"] for r in data["rows"] if r["kernel"] == "_microscaled_cast_kernel"}
    labels = [label for label, _ in kernel_audit_blackwell.quantize_cases()]
    assert {f"{label} transposed" for label in labels} <= casts  # each case's transposed copy is its own kernel
    assert {"mxfp8 e4m3 row", "mxfp4 sr row", "nvfp4 1x16 row", "nvfp4 16x16 row", "nvfp4 16x16 sr row"} <= casts
    amax = {r["case"] for r in data["rows"] if r["kernel"] == "_microscaled_amax_kernel"}
    assert amax == {"nvfp4 1x16", "nvfp4 1x16 rht"}  # plain and Hadamard-transformed (16x16 shares the first)
