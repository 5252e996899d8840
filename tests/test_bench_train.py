"""tools/bench/bench_train.py --quick runs every configuration through the real entry and reports a
consistent table (no timing assertions: throughput is checked only against its own definition), and keeps a
profiler trace of one extra, untimed iteration per run (--profile-dir, as gpu_check.sh runs it)."""
import json
import os
import subprocess
import sys

import pytest

from data_fixtures import REPO_ROOT

NAMES = ["high precision (fp32)", "fp8 delayed", "fp8 tensorwise", "fp8 rowwise", "fp8 blockwise",
         "fp8 delayed + ZeRO fp8 preset"]


def _hand_flops(batch: int, layers: int, h: int, f: int, heads: int, groups: int, s: int, vocab: int) -> int:
    """Megatron's count written out independently (integers): 3 passes x 2 FLOPs per multiply-add."""
    kv = h // heads * groups
    gemm_macs_per_token = layers * (h * (h + 2 * kv) + h * h + 2 * s * h + 3 * h * f) + h * vocab
    return 3 * 2 * batch * s * gemm_macs_per_token


@pytest.mark.slow  # 42 s: a benchmark tool's smoke run (the training it times is tested everywhere else)
def test_quick_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "tools/bench/bench_train.py", "--quick", "--iters", "4", "--warmup", "1",
                             "--json", str(out), "--profile-dir", str(tmp_path / "profiles")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == NAMES
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| run | tokens/s | vs high precision | TFLOP/s | MFU")
    assert [line.split(" | ")[0][2:] for line in table[1:]] == NAMES
    # The quick model: 2 layers, hidden 128, FFN 384 (given: 8/3 x 128 rounded up to 64), 4 heads (MHA), seq 128,
    # micro batch 2; NullTokenizer 1000 + eod = 1001 entries padded to 1024.
    flops = _hand_flops(2, 2, 128, 384, 4, 4, 128, 1024)
    for r in rows:
        assert r["timed_iterations"] == 3  # iterations 2..4 (the profiled 5th is not timed)
        assert abs(r["tokens_per_s"] * r["seconds_per_iteration"] - 2 * 128) < 1e-6
        assert abs(r["tflops"] * 1e12 * r["seconds_per_iteration"] - flops) < 1e-6 * flops
        assert r["mfu_bf16"] is None and r["peak_memory_kind"] == "ru_maxrss" and r["peak_memory_bytes"] > 2**20
        assert 6.0 < r["final_lm_loss"] < 7.5  # random tokens: about ln(1001) = 6.9
        assert r["name"] in "".join(table)
    by_name = {r["name"]: r for r in rows}
    # fp32 everywhere, one process: weights 4 + grads 4 + master 4 + two Adam moments 8 bytes (+ a few
    # scalar buffers: under 1e-4 of a byte per parameter).
    assert abs(by_name["high precision (fp32)"]["model_state_bytes_per_param"] - 20.0) < 1e-3
    assert by_name["fp8 delayed + ZeRO fp8 preset"]["model_state_bytes_per_param"] < 10.0
    # --profile-dir: one trace per configuration, of the untimed extra iteration, with the model's GEMMs in it.
    import gzip

    traces = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert len(traces) == len(NAMES) and "fp8_delayed.json.gz" in traces, traces
    events = json.loads(gzip.open(tmp_path / "profiles" / "fp8_delayed.json.gz").read())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
