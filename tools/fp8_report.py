"""FP8 numerics report: loss parity against a baseline run, grad norm, per-layer FP8 telemetry, MoE expert-load
heatmaps, the runs' suspicious steps (their flight records) and the FP4 grad-noise probes.

    python tools/fp8_report.py RUN_DIR... --output REPORT_DIR [--baseline NAME] [--seq-length N] [--band 0.01]
                               [--pair RUN=REFERENCE]... [--pair-band 0.005]

``--pair RUN=REFERENCE`` also compares RUN with a run that differs from it in one flag (e.g.
``fp8_grad_reduce=fp8_zero_dp2``: the same DP=2 run with and without --fp8-grad-reduce) within --pair-band.

Each RUN_DIR holds a `metrics.jsonl` (directly or in `logs/`) written by `megafp8.pretrain --log-dir`, and
optionally TensorBoard events (anywhere below it) written with `--tensorboard-dir --log-fp8-telemetry`.
Writes REPORT_DIR/report.md and PNG plots. A run is named by its directory's base name.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megafp8.training.flight_record import read_flight_records

# Telemetry stats of megafp8.fp8.collect_fp8_telemetry; "flushed" is accepted as a short name.
SATURATED, FLUSHED, AMAX, KURTOSIS = "saturated", "flushed_to_zero", "amax", "kurtosis"
SMOOTHING = 5  # final training loss: mean of the last N logged records (one step is noisy)
PERSISTENT_SATURATION = 0.01  # a layer saturating more than this on average is named even inside the band


class ReportError(Exception):
    """A user error (bad run directory or flag); printed as one line, no traceback."""


@dataclass
class Run:
    name: str
    path: Path
    train: list[dict]
    valid: list[dict]
    guard_switches: list[dict] = field(default_factory=list)  # {"iteration", "fp8_guard_switch", "saturated"}
    # stat -> layer -> role -> [(step, value)]
    telemetry: dict[str, dict[str, dict[str, list[tuple[int, float]]]]] = field(default_factory=dict)
    suspicious_steps: list[dict] = field(default_factory=list)  # the flight records (megafp8.training.flight_record)
    grad_noise: list[dict] = field(default_factory=list)  # --fp4-until-grad-noise's probes: {"iteration", ratio}

    def final_loss(self, use_validation: bool) -> float:
        if use_validation:
            return self.valid[-1]["val_lm_loss"]
        losses = [r["lm_loss"] for r in self.train if r.get("lm_loss") is not None]
        return float(np.mean(losses[-SMOOTHING:]))

    def spikes(self, ratio: float = 1.1, window: int = 10, min_history: int = 3) -> list[int]:
        """Iterations whose loss exceeds `ratio` x the median of the previous `window` logged losses (fewer,
        but at least `min_history`, early in the run: a spike there counts too)."""
        points = [(r["iteration"], r["lm_loss"]) for r in self.train if r.get("lm_loss") is not None]
        return [it for i, (it, loss) in enumerate(points)
                if i >= min_history and loss > ratio * float(np.median([l for _, l in points[max(0, i - window):i]]))]


def _read_metrics(run_dir: Path) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    candidates = [run_dir / "metrics.jsonl", run_dir / "logs" / "metrics.jsonl"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ReportError(f"run directory {run_dir} has no metrics.jsonl (looked for "
                          f"{', '.join(str(p) for p in candidates)}); pass the --log-dir of a megafp8.pretrain run")
    train, valid, switches, probes = [], [], [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{path} line {number} is not JSON ({e.msg})") from None
        if not isinstance(record, dict) or "iteration" not in record:
            raise ReportError(f"{path} line {number} is not a metrics record (no 'iteration')")
        if "lm_loss" in record:
            train.append(record)
        elif "val_lm_loss" in record:
            valid.append(record)
        elif "fp8_guard_switch" in record:
            switches.append(record)
        elif "fp4_grad_noise_ratio" in record:
            probes.append(record)
    if not train:
        raise ReportError(f"{path} has no training records (none with 'lm_loss')")
    valid = [r for r in valid if r["val_lm_loss"] is not None]
    return train, valid, switches, probes


def _read_telemetry(run_dir: Path) -> dict:
    event_dirs = sorted({p.parent for p in run_dir.rglob("events.out.tfevents*")})
    if not event_dirs:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    telemetry: dict = {}
    for directory in event_dirs:
        events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            parts = tag.split("/")
            if parts[0] != "fp8" or len(parts) != 4:
                continue
            _, layer, role, stat = parts
            stat = FLUSHED if stat == "flushed" else stat
            series = telemetry.setdefault(stat, {}).setdefault(layer, {}).setdefault(role, [])
            series.extend((e.step, e.value) for e in events.Scalars(tag))
    return telemetry


def load_run(path: str) -> Run:
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} " + ("is not a directory" if run_dir.exists() else "does not exist"))
    train, valid, switches, probes = _read_metrics(run_dir)
    log_dir = run_dir if (run_dir / "metrics.jsonl").is_file() else run_dir / "logs"
    try:
        events = read_flight_records(log_dir)
    except ValueError as e:
        raise ReportError(str(e)) from e
    return Run(run_dir.resolve().name, run_dir, train, valid, switches, _read_telemetry(run_dir), events, probes)


def _tokens(run: Run, iterations: list[int], seq_length: int | None) -> tuple[np.ndarray, str]:
    """x values for `iterations`: tokens (consumed samples x seq length) when known, else iterations."""
    if seq_length is None or any("consumed_samples" not in r for r in run.train):
        return np.asarray(iterations, dtype=float), "iteration"
    known_it = [0] + [r["iteration"] for r in run.train]
    known_samples = [0] + [r["consumed_samples"] for r in run.train]
    return np.interp(iterations, known_it, known_samples) * seq_length, "tokens"


def _natural(name: str) -> list:
    # layers.2 before layers.10
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def layer_matrix(run: Run, stat: str) -> tuple[list[str], list[int], np.ndarray]:
    """(layers, steps, [layer, step] max over the layer's tensor roles) of one telemetry stat."""
    by_layer = run.telemetry.get(stat, {})
    layers = sorted(by_layer, key=_natural)
    steps = sorted({s for roles in by_layer.values() for series in roles.values() for s, _ in series})
    matrix = np.full((len(layers), len(steps)), np.nan)
    column = {s: j for j, s in enumerate(steps)}
    for i, layer in enumerate(layers):
        for series in by_layer[layer].values():
            for step, value in series:
                j = column[step]
                matrix[i, j] = value if math.isnan(matrix[i, j]) else max(matrix[i, j], value)
    return layers, steps, matrix


def worst_layers(run: Run, stat: str, top: int = 3) -> list[tuple[str, float]]:
    """Layers with the highest mean (over steps) of `stat`'s max over roles, at least 0.01% (as printed)."""
    layers, _, matrix = layer_matrix(run, stat)
    if not layers:
        return []
    means = np.nanmean(matrix, axis=1)
    order = np.argsort(-means)[:top]
    return [(layers[i], float(means[i])) for i in order if means[i] >= 5e-5]  # 0.01% as printed


def _plot_losses(runs: list[Run], seq_length: int | None, output: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, run in enumerate(runs):
        color = f"C{k % 10}"
        x, label = _tokens(run, [r["iteration"] for r in run.train], seq_length)
        ax.plot(x, [r["lm_loss"] for r in run.train], color=color, lw=1, alpha=0.8, label=f"{run.name} train")
        if run.guard_switches:
            its = [e["iteration"] for e in run.guard_switches]
            xs, _ = _tokens(run, its, seq_length)
            ax.plot(xs, np.interp(its, [r["iteration"] for r in run.train], [r["lm_loss"] for r in run.train]),
                    "v", color=color, ms=8, mec="black", label=f"{run.name}: guard switch")
        if run.valid:
            xv, _ = _tokens(run, [r["iteration"] for r in run.valid], seq_length)
            ax.plot(xv, [r["val_lm_loss"] for r in run.valid], color=color, ls="--", marker="o", ms=3,
                    label=f"{run.name} val")
    ax.set_xlabel(label)
    ax.set_ylabel("lm loss")
    ax.set_title("training (solid) and validation (dashed) loss")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(output / "loss.png", dpi=90)
    plt.close(fig)


def _plot_series(runs: list[Run], baseline: Run, output: Path) -> None:
    import matplotlib.pyplot as plt

    base = {r["iteration"]: r["lm_loss"] for r in baseline.train}
    fig, (gap_ax, norm_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for k, run in enumerate(runs):
        shared = [r for r in run.train
                  if r["iteration"] in base and r["lm_loss"] is not None and base[r["iteration"]]]
        gap_ax.plot([r["iteration"] for r in shared], [100 * (r["lm_loss"] / base[r["iteration"]] - 1) for r in shared],
                    color=f"C{k % 10}", lw=1, label=run.name)
        for event in run.guard_switches:
            gap_ax.axvline(event["iteration"], color=f"C{k % 10}", ls=":", lw=1)
        norm_ax.plot([r["iteration"] for r in run.train], [r.get("grad_norm") for r in run.train],
                     color=f"C{k % 10}", lw=1, label=run.name)
    gap_ax.axhspan(-1, 1, color="green", alpha=0.1, label="1% band")
    gap_ax.set(xlabel="iteration", ylabel="%", title=f"training loss gap to {baseline.name} (dotted: guard switches)")
    norm_ax.set(xlabel="iteration", ylabel="grad norm", title="gradient norm", yscale="log")
    gap_ax.legend(fontsize=6)
    norm_ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(output / "gap_and_grad_norm.png", dpi=90)
    plt.close(fig)


def _plot_telemetry(run: Run, output: Path) -> str | None:
    import matplotlib.pyplot as plt

    panels = [(AMAX, "log10 amax", lambda m: np.log10(np.maximum(m, 1e-30))),
              (SATURATED, "saturated %", lambda m: 100 * m),
              (FLUSHED, "underflow (flushed to zero) %", lambda m: 100 * m),
              (KURTOSIS, "log10 input kurtosis (Gaussian: 0.48)", lambda m: np.log10(np.maximum(m, 1e-30)))]
    panels = [p for p in panels if run.telemetry.get(p[0])]
    if not panels:
        return None
    n_layers = len(layer_matrix(run, panels[0][0])[0])
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 1.5 + 0.22 * n_layers), squeeze=False)
    for ax, (stat, title, transform) in zip(axes[0], panels):
        layers, steps, matrix = layer_matrix(run, stat)
        image = ax.imshow(transform(matrix), aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_title(f"{run.name}: {title} (max over roles; red: guard switch)", fontsize=8)
        ax.set_yticks(range(len(layers)), layers, fontsize=5)
        ticks = np.linspace(0, len(steps) - 1, min(len(steps), 6)).astype(int)
        ax.set_xticks(ticks, [steps[t] for t in ticks], fontsize=6)
        ax.set_xlabel("iteration", fontsize=7)
        for event in run.guard_switches:  # the row goes blank after it: the layer quantizes nothing any more
            if event["fp8_guard_switch"] in layers and steps:
                column = int(np.searchsorted(steps, event["iteration"]))
                ax.plot(min(column, len(steps) - 1), layers.index(event["fp8_guard_switch"]), "v", color="red",
                        ms=6, mec="white")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    name = f"telemetry_{run.name}.png"
    fig.savefig(output / name, dpi=80)
    plt.close(fig)
    return name


def expert_loads(run: Run) -> dict[str, tuple[list[int], np.ndarray]]:
    """Per MoE layer, (logged iterations, [experts, iterations] tokens over the balanced share): 1 is a fair load."""
    records = [r for r in run.train if r.get("moe_tokens_per_expert")]
    layers = sorted({layer for r in records for layer in r["moe_tokens_per_expert"]}, key=_natural)
    loads = {}
    for layer in layers:
        points = [(r["iteration"], r["moe_tokens_per_expert"][layer]) for r in records
                  if layer in r["moe_tokens_per_expert"]]
        matrix = np.asarray([counts for _, counts in points], dtype=float).T
        loads[layer] = ([it for it, _ in points], matrix / np.maximum(matrix.mean(axis=0, keepdims=True), 1e-30))
    return loads


def _expert_load_section(runs: list[Run], output: Path) -> list[str]:
    """The MoE runs' expert loads: the max/mean table, then a heatmap per run (a panel per MoE layer)."""
    import matplotlib.pyplot as plt

    rows, images = [], []
    for run in runs:
        loads = expert_loads(run)
        if not loads:
            continue
        aux = run.train[-1].get("moe_aux_loss")
        for layer, (_, share) in loads.items():
            rows.append(f"| {run.name} | {layer} | {share[:, -1].max():.3f} | {share.max(axis=0).mean():.3f} | "
                        f"{'-' if aux is None else f'{aux:.4f}'} |")
        fig, axes = plt.subplots(1, len(loads), figsize=(3.2 * len(loads), 2.8), squeeze=False)
        for ax, (layer, (steps, share)) in zip(axes[0], loads.items()):
            image = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="magma", vmin=0,
                              vmax=max(2.0, float(share.max())))
            ax.set_title(f"{run.name} {layer}", fontsize=7)
            ax.set_ylabel("expert", fontsize=7)
            ticks = np.linspace(0, len(steps) - 1, min(len(steps), 5)).astype(int)
            ax.set_xticks(ticks, [steps[t] for t in ticks], fontsize=6)
            fig.colorbar(image, ax=ax)
        fig.tight_layout()
        name = f"expert_load_{run.name}.png"
        fig.savefig(output / name, dpi=80)
        plt.close(fig)
        images += [f"![expert load {run.name}]({name})", ""]
    if not rows:
        return []
    return ["## Expert load", "", "Tokens each expert received over the balanced share (1 = fair) in each logged "
            "window: the largest share in the run's last window, and the largest share averaged over the windows.", "",
            "| run | layer | max/mean load (last) | max/mean load (mean over the run) | moe aux loss (last) |",
            "|---|---|---|---|---|", *rows, "", *images]


def verdict(run: Run, baseline: Run, gap: float, band: float) -> str:
    """One plain-words sentence: within/outside the band and, if outside, the layers the telemetry blames."""
    if run is baseline:
        return "baseline"
    extra_spikes = sorted(set(run.spikes()) - set(baseline.spikes()))
    notes = f"; loss spikes the baseline lacks at iterations {extra_spikes}" if extra_spikes else ""
    if run.guard_switches:
        notes += "; the saturation guard moved " + ", ".join(
            f"{e['fp8_guard_switch']} to high precision at iteration {e['iteration']}" for e in run.guard_switches)
    if abs(gap) <= band:
        switched = {e["fp8_guard_switch"] for e in run.guard_switches}  # saturated until the switch, not since
        saturating = [(layer, v) for layer, v in worst_layers(run, SATURATED)
                      if v > PERSISTENT_SATURATION and layer not in switched]
        if saturating:  # inside the band for now, but a layer keeps clipping: say so
            notes += "; still saturating: " + ", ".join(f"{layer} ({100 * v:.2f}% on average)"
                                                       for layer, v in saturating)
        return f"within the {100 * band:g}% band ({100 * gap:+.2f}%){notes}"
    sentence = f"OUTSIDE the {100 * band:g}% band ({100 * gap:+.2f}%){notes}"
    saturated, flushed = worst_layers(run, SATURATED), worst_layers(run, FLUSHED)
    if not run.telemetry:
        return sentence + "; no FP8 telemetry logged to explain it (run with --log-fp8-telemetry --tensorboard-dir)"
    blame = []
    if saturated:
        blame.append("most saturation in " + ", ".join(f"{layer} ({100 * v:.2f}%)" for layer, v in saturated))
    if flushed:
        blame.append("most underflow in " + ", ".join(f"{layer} ({100 * v:.2f}%)" for layer, v in flushed))
    return sentence + "; " + ("; ".join(blame) if blame else "telemetry shows no saturation or underflow")


def _guard_section(runs: list[Run]) -> list[str]:
    """A table of every run's saturation-guard switches (the layers that left FP8, when and why)."""
    def percent(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.2f}%"

    rows = [f"| {run.name} | {e['iteration']} | {e['fp8_guard_switch']} | {percent(e.get('saturated'))} |"
            for run in runs for e in run.guard_switches]
    if not rows:
        return ["## FP8 saturation guard", "", "No run switched a layer to high precision.", ""]
    return ["## FP8 saturation guard", "",
            "Layers the guard moved to high precision (saturated fraction above its threshold for several "
            "consecutive steps); from then on they run in high precision and report no FP8 telemetry.", "",
            "| run | after iteration | layer | saturated |", "|---|---|---|---|", *rows, ""]


def _suspicious_section(runs: list[Run]) -> list[str]:
    """A table of every run's suspicious steps (--rerun-mode's flight records): what, why, what was done."""
    rows = []
    for run in runs:
        for e in run.suspicious_steps:
            where = e.get("first_nonfinite") or {}
            found = (f"{where['module']} ({where['pass']}, rank {where['rank']})" if where else "-")
            samples = ", ".join(map(str, where.get("samples", []))) or "-"
            rows.append(f"| {run.name} | {e['iteration']} | {e['kind']} | {e['diagnosis']} | {e['action']} | "
                        f"{found} | {samples} | `flight_records/{e['file']}` |")
    if not rows:
        return ["## Suspicious steps", "", "No run had a step fail its result checks.", ""]
    return ["## Suspicious steps", "",
            "Steps whose loss or grad norm failed a result check (non-finite, or a spike), with the re-run's "
            "diagnosis; the first non-finite module and its samples come from the re-run's hooks "
            "(`tools/show_samples.py RECORD` prints the samples' text).", "",
            "| run | iteration | kind | diagnosis | action | first non-finite | samples | record |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]


def _grad_noise_section(runs: list[Run], output: Path) -> list[str]:
    """--fp4-until-grad-noise's probes: the FP4 weight gradients' norm over their quantization noise per run, against
    the paper's sqrt(3) (the switch fires below the run's --fp4-grad-noise-threshold, sqrt(3) by default)."""
    probed = [run for run in runs if run.grad_noise]
    if not probed:
        return []
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, run in enumerate(probed):
        points = [(r["iteration"], r["fp4_grad_noise_ratio"]) for r in run.grad_noise
                  if r["fp4_grad_noise_ratio"] is not None]
        ax.plot(*zip(*points), marker=".", lw=1, color=f"C{k % 10}", label=run.name)
    ax.axhline(math.sqrt(3), color="red", ls="--", lw=1, label="sqrt(3)")
    ax.set(xlabel="iteration", ylabel="||wgrad|| / ||FP4 noise||", yscale="log",
           title="FP4 weight gradients over their quantization noise")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(output / "fp4_grad_noise.png", dpi=90)
    plt.close(fig)
    lines = ["## FP4 gradient vs quantization noise", "",
             "--fp4-until-grad-noise's probes (\"FP4 All the Way\": FP4 training stops paying below sqrt(3)). "
             "The last probe of a run is the one at its switch, if it switched.", "",
             "| run | probes | first ratio | last ratio | min ratio |", "|---|---|---|---|---|"]
    for run in probed:
        ratios = [r["fp4_grad_noise_ratio"] for r in run.grad_noise if r["fp4_grad_noise_ratio"] is not None]
        lines.append(f"| {run.name} | {len(run.grad_noise)} | {ratios[0]:.3f} | {ratios[-1]:.3f} | {min(ratios):.3f} |"
                     if ratios else f"| {run.name} | {len(run.grad_noise)} | - | - | - |")
    return lines + ["", "![FP4 grad noise](fp4_grad_noise.png)", ""]


def _pair_section(runs: list[Run], pairs: list[tuple[str, str]], use_validation: bool, band: float) -> list[str]:
    """RUN vs its one-flag REFERENCE: final-loss gap and the largest per-iteration training-loss gap."""
    if not pairs:
        return []
    by_name = {r.name: r for r in runs}
    lines = ["## Paired runs", "", f"Each run against the run that differs from it in one flag. Band: {100 * band:g}%.", "",
             "| run | reference | final loss gap | max train-loss gap over iterations | verdict |", "|---|---|---|---|---|"]
    for name, ref_name in pairs:
        for missing in (name, ref_name):
            if missing not in by_name:
                raise ReportError(f"--pair {name}={ref_name}: {missing} is not one of the runs {sorted(by_name)}")
        run, ref = by_name[name], by_name[ref_name]
        gap = run.final_loss(use_validation) / ref.final_loss(use_validation) - 1
        ref_train = {r["iteration"]: r["lm_loss"] for r in ref.train if r.get("lm_loss") is not None}
        per_iter = [abs(r["lm_loss"] / ref_train[r["iteration"]] - 1) for r in run.train
                    if r.get("lm_loss") is not None and r["iteration"] in ref_train]
        within = "within" if abs(gap) <= band else "OUTSIDE"
        lines.append(f"| {name} | {ref_name} | {100 * gap:+.3f}% | {100 * max(per_iter, default=0.0):.3f}% | "
                     f"{within} the {100 * band:g}% band |")
    return lines + [""]


def write_report(runs: list[Run], baseline_name: str | None, output: Path, seq_length: int | None = None,
                 band: float = 0.01, pairs: list[tuple[str, str]] | None = None, pair_band: float = 0.005) -> Path:
    """Plots and report.md for `runs` against the baseline (the first run unless named); returns report.md."""
    import matplotlib

    matplotlib.use("Agg")
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ReportError(f"run directories must have distinct names, got {names}")
    if baseline_name is None:
        baseline = runs[0]
    elif baseline_name in names:
        baseline = runs[names.index(baseline_name)]
    else:
        raise ReportError(f"--baseline {baseline_name} is not one of the runs {names}")
    output.mkdir(parents=True, exist_ok=True)
    use_validation = all(r.valid for r in runs)
    _plot_losses(runs, seq_length, output)
    _plot_series(runs, baseline, output)
    base_loss = baseline.final_loss(use_validation)
    kind = "validation" if use_validation else f"training (mean of the last {SMOOTHING} logged)"
    lines = ["# FP8 numerics report", "",
             f"Baseline: `{baseline.name}`. Final loss: {kind}. Band: {100 * band:g}% relative gap.", "",
             "| run | iterations | final train loss | final val loss | gap to baseline | skipped | verdict |",
             "|---|---|---|---|---|---|---|"]
    for run in runs:
        loss = run.final_loss(use_validation)
        gap = loss / base_loss - 1
        val = f"{run.valid[-1]['val_lm_loss']:.4f}" if run.valid else "-"
        lines.append(f"| {run.name} | {run.train[-1]['iteration']} | {run.final_loss(False):.4f} | {val} | "
                     f"{100 * gap:+.2f}% | {run.train[-1].get('skipped_iterations', 0)} | "
                     f"{verdict(run, baseline, gap, band)} |")
    lines += ["", "![loss](loss.png)", "", "![gap and grad norm](gap_and_grad_norm.png)", ""]
    lines += _pair_section(runs, pairs or [], use_validation, pair_band)
    lines += _guard_section(runs)
    lines += _suspicious_section(runs)
    lines += _expert_load_section(runs, output)
    lines += _grad_noise_section(runs, output)
    for run in runs:
        image = _plot_telemetry(run, output)
        if image:
            lines += [f"## FP8 telemetry: {run.name}", "",
                      "Per layer, the max over its tensor roles (input, weight, grad_output) at each logged step.", "",
                      f"![telemetry {run.name}]({image})", ""]
    report = output / "report.md"
    report.write_text("\n".join(lines))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--output", required=True, metavar="REPORT_DIR")
    parser.add_argument("--baseline", help="run name (directory base name) to compare against; default: the first")
    parser.add_argument("--seq-length", type=int, help="tokens per sample: plot loss against tokens")
    parser.add_argument("--band", type=float, default=0.01, help="relative final-loss gap counted as parity")
    parser.add_argument("--pair", action="append", default=[], metavar="RUN=REFERENCE",
                        help="also compare RUN with REFERENCE (runs that differ in one flag); repeatable")
    parser.add_argument("--pair-band", type=float, default=0.005, help="relative final-loss gap counted as parity "
                        "for --pair")
    args = parser.parse_args(argv)
    pairs = [tuple(p.split("=", 1)) for p in args.pair]
    bad = [p for p, parsed in zip(args.pair, pairs) if len(parsed) != 2 or not all(parsed)]
    if bad:
        parser.error(f"--pair takes RUN=REFERENCE, got {bad[0]!r}")
    if importlib.util.find_spec("matplotlib") is None:  # checked first: not after reading every run
        print("fp8_report: error: the report's plots need the matplotlib package, which is not installed: "
              "pip install matplotlib (or pip install -e \".[report]\")", file=sys.stderr)
        return 2
    try:
        runs = [load_run(path) for path in args.runs]
        report = write_report(runs, args.baseline, Path(args.output), args.seq_length, args.band, pairs,
                              args.pair_band)
    except ReportError as e:
        print(f"fp8_report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
