"""tools/bench/bench_host_overhead.py: the 1B example's real step runs end to end on meta (hidden 2048, FFN 8192,
seq 2048, vocabulary 128256; 2 layers and 2 micro-batches) without real memory and without a host read, eager and
aot_eager-compiled; its flags are the example script's; its arithmetic against hand-computed values."""
import json
import os
import subprocess
import sys

import pytest

from data_fixtures import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "bench"))
from bench_host_overhead import (  # noqa: E402
    DATA,
    breakeven_mfu,
    example_flags,
    flops_by_precision,
    gpu_ms,
    host_bound,
    host_on_gpu_ms,
)


def test_flags_are_the_single_gpu_example():
    with open(os.path.join(REPO_ROOT, "examples", "pretrain_single_gpu.sh")) as f:
        script = " ".join(f.read().replace("(", " ").replace(")", " ").split())
    flags = example_flags("delayed")
    start = next(i for i in range(len(flags)) if tuple(flags[i:i + len(DATA)]) == DATA)
    flags = flags[:start] + flags[start + len(DATA):]  # the data stands in for the script's --data-path
    pairs = [f"{flag} {value}" if not value.startswith("--") else flag
             for flag, value in zip(flags, flags[1:] + ["--"]) if flag.startswith("--")]
    missing = [pair for pair in pairs if f" {pair} " not in f" {script} "]
    assert not missing, missing
    assert not [f for f in example_flags("bf16") if f.startswith("--fp8")]


def test_flops_split_by_precision_by_hand():
    # h 4, FFN 8, 2 heads of 2, 1 KV group, seq 3, vocab 10: per token forward QKV 2*4*(4+2*2) = 64, projection
    # 2*4*4 = 32, MLP 3*2*4*8 = 192 (linear 288); attention 2*2*3*4 = 48; logits 2*4*10 = 80; x 3 passes x 3 tokens.
    linear, other = flops_by_precision(1, num_layers=1, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2,
                                       num_query_groups=1, seq_length=3, padded_vocab_size=10)
    assert (linear, other) == (9 * 288, 9 * (48 + 80))


def test_gpu_time_and_host_bound_by_hand():
    # 2 TFLOP at 2000 TFLOP/s = 1 ms, 1 TFLOP at 1000 = 1 ms; at half of peak: 4 ms
    assert gpu_ms(2e12, 1e12, 2000, 1000, 0.5) == pytest.approx(4.0)
    assert host_on_gpu_ms(10.0, 1000, 100, 4.0, 10.0) == pytest.approx(15.0)  # + 4 ms + 1 ms of launches
    assert host_bound(15.0, 10.0) == pytest.approx({"host_over_gpu": 1.5, "gpu_idle_fraction": 1 / 3})
    assert host_bound(5.0, 10.0) == pytest.approx({"host_over_gpu": 0.5, "gpu_idle_fraction": 0.0})
    assert breakeven_mfu(5.0, 10.0, 0.4) == pytest.approx(0.8)  # twice the MFU halves the GPU's 10 ms to the host's 5


def test_meta_step_of_the_1b_example_runs_without_memory_or_host_reads(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "bench", "bench_host_overhead.py"),
                    "--layers", "2", "--micro-batches", "2", "--recipes", "bf16,delayed", "--compile",
                    "--warmup", "1", "--iterations", "1", "--json", str(out)], check=True, cwd=REPO_ROOT,
                   capture_output=True, text=True)
    result = json.loads(out.read_text())
    rows = {(r["recipe"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {("bf16", "eager"), ("delayed", "eager"), ("bf16", "aot_eager"), ("delayed", "aot_eager")}
    # Two 1B-width layers and the 128k vocabulary are 0.6 B parameters: 1.2 GB in bf16 before any optimizer state.
    assert result["peak_rss_mib"] < 1536
    for (recipe, mode), row in rows.items():
        assert row["model"]["hidden_size"] == 2048 and row["model"]["seq_length"] == 2048
        assert row["model_state_on_meta"] and row["real_tensor_bytes"] < 2 ** 20, (recipe, mode)
        for phase, counts in row["launches"].items():  # steady state: the device is never read, the CPU never used
            assert not counts["host_reads"] and not counts["cpu_ops"], (recipe, mode, phase, counts)
        assert row["host_ms"]["forward_backward"] > 0 and row["host_ms"]["optimizer"] > 0
        assert row["launches"]["optimizer"]["triton"] > 0  # the fused step's launches, counted on meta
        assert row["layer"]["aten"] > 0 and row["step"]["gpu_ms"] > row["layer"]["gpu_ms"] > 0
        assert (row["layer"]["triton"] > 0) == (recipe != "bf16")  # the FP8 casts and GEMMs
        assert (row["launches"]["guard"]["aten"] > 0) == (recipe != "bf16")  # the saturation guard's check
