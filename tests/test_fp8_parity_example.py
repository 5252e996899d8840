"""examples/fp8_parity.sh --quick (a reduced model): every FP8, MX and FP4 mode trains (final loss below its first) and
stays within a loose 10% of the fp32 baseline's final validation loss (the FOG and μnit Scaling rows: of their own fp32
runs); the report lists every run; the precision
schedule rows switch at 0.8 of the run; the guard
moves the layer the forced-overflow hook clips to high precision, and only in the run that has the guard."""
import json
import os
import subprocess

import pytest

from data_fixtures import REPO_ROOT

# The default run: one row per recipe family the other default tests do not train through this script (per-tensor,
# the guard pair, MX, NVFP4 and its schedule); -m slow runs every row of the script, the blockwise, FP8 attention,
# architectures' (FOG, μnit Scaling) and MoE's rows included (their own tests run by default: test_training_3d,
# test_fp8_attention, test_fog_block, test_static_fp8, test_moe_training).
RUNS = ["fp32", "fp8_delayed", "fp8_overflow_guarded", "fp8_overflow_unguarded", "mxfp8", "nvfp4", "nvfp4_then_bf16"]
ALL_RUNS = ["fp32", "fp8_delayed", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "fp8_zero_compressed",
            "fp8_delayed_smooth_swiglu", "fp8_overflow_guarded", "fp8_overflow_unguarded", "mxfp8", "nvfp4",
            "nvfp4_no_sr", "nvfp4_no_rht", "nvfp4_no_2d", "mxfp4", "nvfp4_then_bf16", "nvfp4_fprop_bf16",
            "nvfp4_grad_noise", "fog_fp32",
            "fog_fp8", "mus_fp32", "mus_static", "fp8_attention", "fog_fp8_attention", "moe_fp32", "moe_blockwise",
            "moe_bias_fp32"]
# The architectures against their own fp32 run; those runs are other models (not compared with the Llama's fp32).
OWN_BASELINE = {"fog_fp8": "fog_fp32", "mus_static": "mus_fp32", "fog_fp8_attention": "fog_fp32",
                "moe_blockwise": "moe_fp32"}
SCHEDULES = {"nvfp4_then_bf16": "FP4 layers switch to high precision at iteration 17",  # 0.8 of 20 iterations
             "nvfp4_fprop_bf16": "FP4 layers switch to the forward GEMMs in high precision (dgrad/wgrad stay FP4) "
                                 "at iteration 17"}


@pytest.mark.parametrize("runs", [RUNS, pytest.param(ALL_RUNS, marks=pytest.mark.slow)], ids=["families", "all"])
def test_quick_parity_script_every_fp8_run_learns_near_the_baseline(tmp_path, runs):
    # The runs asserted here (the DP=2 pair of --fp8-grad-reduce is tests/test_fp8_grad_reduce.py's, in 3D).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARITY_ITERS": "20", "PARITY_RUNS": " ".join(runs),
           "PARITY_MODEL": "--num-layers 1 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 "
                           "--seq-length 32 --micro-batch-size 4 --global-batch-size 4"}
    result = subprocess.run(["bash", os.path.join(REPO_ROOT, "examples", "fp8_parity.sh"), "--quick", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    final_val, switches = {}, {}
    for name in runs:
        records = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        switches[name] = [(r["iteration"], r["fp8_guard_switch"]) for r in records if "fp8_guard_switch" in r]
        train = [r["lm_loss"] for r in records if "lm_loss" in r]
        final_val[name] = [r["val_lm_loss"] for r in records if "val_lm_loss" in r][-1]
        assert len(train) == 20 // 5 and train[-1] < train[0], (name, train)
        if not name.endswith("fp32"):  # telemetry went to TensorBoard for the FP8 runs
            assert list((tmp_path / "runs" / name / "tb").glob("events.out.tfevents*")), name
    for name in (n for n in runs[1:] if n not in OWN_BASELINE.values()):
        baseline = OWN_BASELINE.get(name, "fp32")
        assert abs(final_val[name] / final_val[baseline] - 1) < 0.10, (name, final_val)
    # The guard in practice: forced from iteration 20 / 5 = 4, the layer leaves FP8 after 3 saturated steps;
    # nothing else switches, and without the guard nothing does.
    assert switches.pop("fp8_overflow_guarded") == [(6, "layers.0.mlp.linear_fc2")]
    assert not any(switches.values()), switches
    for name, switch in ((n, s) for n, s in SCHEDULES.items() if n in runs):  # switched where the fraction says
        assert f"precision schedule: {switch}" in (tmp_path / "runs" / f"{name}.log").read_text(), name
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| fp8_overflow_guarded | 6 | layers.0.mlp.linear_fc2 |" in report
    assert all(f"| {name} | 20 |" in report for name in runs)
    assert (tmp_path / "report" / "telemetry_fp8_delayed.png").exists()
    if "moe_blockwise" in runs:  # the MoE pair: -m slow (the heatmap is test_moe_training's too)
        assert "## Expert load" in report and (tmp_path / "report" / "expert_load_moe_blockwise.png").exists()
