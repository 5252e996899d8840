"""bench_gemm.py --wgrad on CPU: the mode runs, times both wgrad routes (Triton-style accumulate into the fp32
main_grad, torch._scaled_mm + add_ in bf16/fp32) and says the routing stays; the numbers themselves are GPU work."""
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tools" / "bench"))
import bench_gemm  # noqa: E402


@pytest.mark.slow  # CI time: a benchmark's smoke run (the routes' equality below runs by default)
def test_wgrad_mode_times_both_routes(tmp_path, capsys):
    assert bench_gemm.main(["--wgrad", "--quick", "--json", str(tmp_path / "w.json")]) == 0
    rows = json.loads((tmp_path / "w.json").read_text())["rows"]
    names = {r["name"] for r in rows}
    assert {"megafp8 reference tensorwise accumulate into fp32", "torch._scaled_mm tensorwise bfloat16 + add_",
            "torch._scaled_mm tensorwise float32 + add_", "torch._scaled_mm rowwise bfloat16 + add_"} <= names
    assert all(r["kind"] == "wgrad" and r["ms"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "# wgrad tensorwise: reference accumulate time / (torch._scaled_mm tensorwise float32 + add_) time" in out
    assert "wgrad routing is unchanged" in out


def test_wgrad_routes_add_the_same_product():
    """Each timed callable adds dY^T X once into main_grad, and every route adds the same product (the fp64
    product of the unquantized operands, within FP8 tensorwise/rowwise quantization error)."""
    import torch

    from fp8_testing import sqnr_db

    M, N, K = 64, 96, 256
    cases, main_grad = bench_gemm._wgrad_cases(M, N, K, "cpu", "reference")
    g = torch.Generator().manual_seed(1)  # the operands _wgrad_cases draws
    dy_t, x_t = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    exact = dy_t.double() @ x_t.double().t()
    for name, add_once in cases.items():
        main_grad.fill_(1.0)
        add_once()
        assert sqnr_db(main_grad - 1.0, exact) >= 25.0, name
