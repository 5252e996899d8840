"""tools/fp8_report.py on synthetic runs: the files it writes, its table, its verdicts (inside and outside the
1% band, naming the layers whose telemetry saturates/underflows), and one-line errors for bad run directories."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from data_fixtures import REPO_ROOT

# Loaded from its path: putting tools/ on sys.path would let its scripts shadow modules for the other tests.
_spec = importlib.util.spec_from_file_location("fp8_report", os.path.join(REPO_ROOT, "tools", "fp8_report.py"))
fp8_report = sys.modules["fp8_report"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(fp8_report)

LAYERS = ["0.layers.0.mlp.linear_fc1", "0.layers.1.mlp.linear_fc2", "0.layers.10.self_attention.linear_qkv"]


def _write_run(path, loss_scale: float, val_losses: list[float], iters: int = 20) -> None:
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for it in range(1, iters + 1):
            f.write(json.dumps({"iteration": it, "consumed_samples": 4 * it, "lm_loss": loss_scale * (8 - 0.1 * it),
                                "grad_norm": 1.0 / it, "lr": 1e-3, "tokens_per_s": 1000.0,
                                "skipped_iterations": 0}) + "\n")
            if it % 10 == 0:
                f.write(json.dumps({"iteration": it, "val_lm_loss": val_losses[it // 10 - 1]}) + "\n")


def _write_telemetry(path, saturated_layer: str, flushed_layer: str) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(path / "tb"))
    for step in (5, 10, 15, 20):
        writer.add_scalar("train/lm_loss", 1.0, step)  # non-FP8 tags are ignored
        for layer in LAYERS:
            for role in ("input", "weight", "grad_output"):
                writer.add_scalar(f"fp8/{layer}/{role}/amax", 2.0, step)
                writer.add_scalar(f"fp8/{layer}/{role}/scale", 100.0, step)
                hot = layer == saturated_layer and role == "input"
                writer.add_scalar(f"fp8/{layer}/{role}/saturated", 0.05 if hot else 0.0, step)
                cold = layer == flushed_layer and role == "grad_output"
                writer.add_scalar(f"fp8/{layer}/{role}/flushed_to_zero", 0.2 if cold else 0.001, step)
    writer.close()


@pytest.fixture
def runs(tmp_path):
    _write_run(tmp_path / "baseline", 1.0, [7.0, 6.0])
    _write_run(tmp_path / "fp8_close", 1.001, [7.01, 6.03])  # +0.5%
    _write_run(tmp_path / "fp8_far", 1.05, [7.5, 6.3])  # +5%
    _write_telemetry(tmp_path / "fp8_close", LAYERS[0], LAYERS[0])
    _write_telemetry(tmp_path / "fp8_far", LAYERS[2], LAYERS[1])
    return tmp_path


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "fp8_report.py"), *args],
                          capture_output=True, text=True, timeout=120)


def _table(report: str) -> dict[str, list[str]]:
    first_table = report[report.index("| run |"):].split("\n\n")[0]  # the guard section has a table of its own
    rows = [line.strip("|").split("|") for line in first_table.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_report_files_table_and_verdicts(runs):
    out = runs / "report"
    result = _report(str(runs / "baseline"), str(runs / "fp8_close"), str(runs / "fp8_far"), "--output", str(out),
                     "--seq-length", "64")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gap_and_grad_norm.png", "loss.png", "report.md",
                                                     "telemetry_fp8_close.png", "telemetry_fp8_far.png"]
    assert all((out / name).read_bytes()[:4] == b"\x89PNG" for name in os.listdir(out) if name.endswith(".png"))
    report = (out / "report.md").read_text()
    table = _table(report)
    assert list(table) == ["baseline", "fp8_close", "fp8_far"]
    # iterations, final train loss (mean of last 5: 8 - 0.1 * 18), final val loss, gap, skipped
    assert table["baseline"][:5] == ["20", "6.2000", "6.0000", "+0.00%", "0"]
    assert table["fp8_close"][2:4] == ["6.0300", "+0.50%"] and table["fp8_far"][2:4] == ["6.3000", "+5.00%"]
    assert table["baseline"][5] == "baseline"
    # inside the band, but a layer clipping 5% of its input on average is named
    assert table["fp8_close"][5] == f"within the 1% band (+0.50%); still saturating: {LAYERS[0]} (5.00% on average)"
    far = table["fp8_far"][5]
    assert far.startswith("OUTSIDE the 1% band (+5.00%)")
    assert f"most saturation in {LAYERS[2]} (5.00%)" in far  # only the hot layer: zero-saturation layers not named
    assert f"most underflow in {LAYERS[1]} (20.00%)" in far  # the worst underflowing layer first
    assert "telemetry_fp8_far.png" in report


def test_baseline_flag_and_telemetry_matrix(runs):
    result = _report(str(runs / "baseline"), str(runs / "fp8_far"), "--output", str(runs / "r"),
                     "--baseline", "fp8_far")
    assert result.returncode == 0, result.stderr
    table = _table((runs / "r" / "report.md").read_text())
    assert table["fp8_far"][5] == "baseline" and table["baseline"][3] == f"{100 * (6.0 / 6.3 - 1):+.2f}%"
    layers, steps, matrix = fp8_report.layer_matrix(fp8_report.load_run(str(runs / "fp8_far")), "saturated")
    assert layers == LAYERS and steps == [5, 10, 15, 20]  # natural order: layers.1 before layers.10
    assert matrix[2].tolist() == pytest.approx([0.05] * 4) and matrix[:2].max() == 0.0


def test_spike_the_baseline_lacks_is_reported(runs):
    lines = (runs / "fp8_close" / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[15])
    record["lm_loss"] *= 1.5
    lines[15] = json.dumps(record)
    (runs / "fp8_close" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert _report(str(runs / "baseline"), str(runs / "fp8_close"), "--output", str(runs / "r")).returncode == 0
    verdict = _table((runs / "r" / "report.md").read_text())["fp8_close"][5]
    spike = record["iteration"]
    assert verdict.startswith(f"within the 1% band (+0.50%); loss spikes the baseline lacks at iterations [{spike}]")


def test_runs_without_validation_compare_final_training_loss(tmp_path):
    for name, scale in (("a", 1.0), ("b", 1.02)):
        _write_run(tmp_path / name, scale, [0, 0])
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(l for l in lines if "val_lm_loss" not in l))
    assert _report(str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(tmp_path / "r")).returncode == 0
    report = (tmp_path / "r" / "report.md").read_text()
    assert "Final loss: training (mean of the last 5 logged)" in report
    verdict = _table(report)["b"][5]
    assert verdict.startswith("OUTSIDE the 1% band (+2.00%); no FP8 telemetry logged")


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "run directory {d} does not exist"),
    (lambda d: d.mkdir(), "run directory {d} has no metrics.jsonl"),
    (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"iteration": 1, "lm_loss": 2.0}\n{oops\n')),
     "{d}/metrics.jsonl line 2 is not JSON"),
    (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"lm_loss": 2.0}\n')),
     "{d}/metrics.jsonl line 1 is not a metrics record"),
    (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"iteration": 1, "val_lm_loss": 2.0}\n')),
     "{d}/metrics.jsonl has no training records"),
])
def test_bad_run_directory_is_one_clear_error(runs, setup, message):
    bad = runs / "bad"
    setup(bad)
    result = _report(str(runs / "baseline"), str(bad), "--output", str(runs / "r"))
    assert result.returncode == 2
    assert result.stderr.startswith("fp8_report: error: " + message.format(d=bad))
    assert "Traceback" not in result.stderr


def test_unknown_baseline_is_one_clear_error(runs):
    result = _report(str(runs / "baseline"), "--output", str(runs / "r"), "--baseline", "nope")
    assert result.returncode == 2 and "--baseline nope is not one of the runs ['baseline']" in result.stderr


def test_report_shows_the_guard_switches(runs):
    with open(runs / "fp8_far" / "metrics.jsonl", "a") as f:  # as megafp8.training.training_log writes them
        f.write(json.dumps({"iteration": 12, "fp8_guard_switch": LAYERS[2], "saturated": 0.05}) + "\n")
    out = runs / "report"
    assert _report(str(runs / "baseline"), str(runs / "fp8_close"), str(runs / "fp8_far"), "--output", str(out)).returncode == 0
    report = (out / "report.md").read_text()
    assert f"| fp8_far | 12 | {LAYERS[2]} | 5.00% |" in report
    assert f"the saturation guard moved {LAYERS[2]} to high precision at iteration 12" in _table(report)["fp8_far"][5]
    assert "the saturation guard" not in _table(report)["fp8_close"][5]


def test_report_plots_the_fp4_grad_noise_probes(runs):
    with open(runs / "fp8_far" / "metrics.jsonl", "a") as f:  # as TrainingLog.log_grad_noise writes them
        for it, ratio in ((5, 4.0), (10, 2.5), (15, 1.5)):
            f.write(json.dumps({"iteration": it, "fp4_grad_noise_ratio": ratio}) + "\n")
    out = runs / "report"
    assert _report(str(runs / "baseline"), str(runs / "fp8_far"), "--output", str(out)).returncode == 0
    report = (out / "report.md").read_text()
    assert "| fp8_far | 3 | 4.000 | 1.500 | 1.500 |" in report and "| baseline | 3" not in report
    assert (out / "fp4_grad_noise.png").stat().st_size > 0


def test_report_says_when_no_layer_switched(runs):
    out = runs / "report"
    assert _report(str(runs / "baseline"), str(runs / "fp8_close"), "--output", str(out)).returncode == 0
    assert "No run switched a layer to high precision." in (out / "report.md").read_text()


def test_spikes_early_in_the_run_count_too():
    """A spike before `window` logged points (the forced overflow at 1/5 of a short run) is still found."""
    losses = [8.0, 7.5, 7.0, 6.8, 9.0, 6.5, 6.4]
    run = fp8_report.Run("r", None, [{"iteration": 10 * (i + 1), "lm_loss": v} for i, v in enumerate(losses)], [])
    assert run.spikes() == [50]
