"""The fused FP8 publication's kernels (megafp8/optim/fused_fp8_publication.py) in the offline sm_90a audit: every
specialization a step launches (fp32/fp16 master amax; E4M3, E5M2 and mixed casts) compiles for Hopper without a GPU,
at CUDA's launch sizes and with the hardware rounding a GPU uses, and spills nothing. Under the installed Triton, in a
process of its own (the test session imports Triton's interpreter; the full audit, gpu_check.sh's precompile step,
also compiles these cases under 3.6.0)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tools" / "bench"))
import kernel_audit  # noqa: E402

AUDIT = """
import json, sys
import torch
import kernel_audit as K
from audit_optimizer_cases import fp8_publication_cases, gpu_launch_sizes
from megafp8.optim import fused_fp8_publication as P
failures = []
with gpu_launch_sizes():
    launch = {"rows": P._rows(torch.device("cpu")), "software_rounding": P._software_rounding(torch.device("cpu"))}
    rows = K.compiled_case_rows(fp8_publication_cases(), lambda case, kernel: "", K.ptxas_path(), failures,
                                lambda index: True, 0)
launch["restored"] = P._software_rounding(torch.device("cpu"))
json.dump({"rows": rows, "failures": failures, "launch": launch, "gpu_rows": P.GPU_ROWS}, sys.stdout)
"""


def test_publication_kernels_compile_for_hopper_without_spills(tmp_path):
    if kernel_audit.ptxas_path() is None:
        pytest.skip("the Triton wheel has no ptxas for sm_90a: the audit cannot run")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile real kernels
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO_ROOT / "tools" / "bench"))
    result = subprocess.run([sys.executable, "-c", AUDIT], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["failures"] == [], report["failures"]
    assert report["launch"] == {"rows": report["gpu_rows"], "software_rounding": False, "restored": True}
    cases = {(r["kernel"], r["case"]) for r in report["rows"]}
    assert {kernel for kernel, _ in cases} == {"_group_amax_kernel", "_cast_kernel"} and len(cases) == 8
    assert ("_cast_kernel", "fp16 master into e4m3+e5m2") in cases
    assert all(r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0 and 0 < r["registers"] <= 255
               for r in report["rows"]), report["rows"]
