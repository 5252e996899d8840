"""What a training run reports: the Megatron-shaped console line, `metrics.jsonl`, and the same scalars to
TensorBoard and to Weights & Biases (`--wandb-project`).

Only the caller decides what to log (rank 0 usually); this module formats and writes. The keys of a
metrics.jsonl record are a public contract (DESIGN.md): `iteration`, `lm_loss`, `grad_norm`, `lr`,
`tokens_per_s`, `skipped_iterations`, `comm_bytes` (bytes this rank sent per collective kind since the
previous record), `model_state_bytes_per_param`; validation records carry `val_lm_loss`; the FP8 saturation
guard's switches are records with `fp8_guard_switch` (the layer) and `saturated` (its saturated fraction).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megafp8.parallel.collectives import COMM_KINDS

if TYPE_CHECKING:
    import torch

# Dense peak TFLOP/s per device (no sparsity), for MFU. Matched by substring of the CUDA device name.
PEAK_TFLOPS = {  # name: (bf16, fp8)
    "H200": (989.0, 1979.0),
    "H100": (989.0, 1979.0),  # SXM; PCIe/NVL parts are lower: MFU then reads high
    "H800": (989.0, 1979.0),
    "B200": (2250.0, 4500.0),
}


def device_peak_tflops(device_name: str) -> tuple[float, float] | None:
    """(bf16, fp8) dense peaks of a known GPU, else None (CPU: no MFU is reported)."""
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in device_name), None)


@dataclass
class IterationRecord:
    """One logged training iteration (the fields of metrics.jsonl, plus throughput for the console)."""

    iteration: int
    train_iters: int
    consumed_samples: int
    lm_loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    skipped_iterations: int
    nan_iterations: int
    elapsed_ms_per_iteration: float
    tflops_per_device: float
    comm_bytes: dict[str, int] = field(default_factory=dict)
    model_state_bytes_per_param: float = float("nan")
    mfu_bf16: float | None = None
    mfu_fp8: float | None = None
    loss_scale: float | None = None  # --fp16 only (Megatron prints it between the loss and the grad norm)
    # --num-experts only: the routers' coefficient-free balancing and z losses (means over the MoE layers, the window's
    # micro-batches and the replicas) and each layer's tokens per expert over the window (megafp8.model.moe_stats)
    moe_aux_loss: float | None = None
    moe_z_loss: float | None = None
    moe_tokens_per_expert: dict[str, list[int]] | None = None
    # Several ranks: each rank's time per iteration outside collective waits (megafp8.training.stragglers)
    rank_work_ms: list[float] | None = None
    # --rerun-mode report_stats: the window's largest relative differences between a step's two runs (any rank)
    rerun_loss_rel_diff: float | None = None
    rerun_grad_norm_rel_diff: float | None = None
    # Console only (not metrics.jsonl): wall time since this process started training, and the time the
    # remaining iterations take at this record's rate.
    elapsed_s: float | None = None
    eta_s: float | None = None

    def console_line(self) -> str:
        """Megatron's log line (DESIGN.md), one field per `|`."""
        fields = [
            f"iteration {self.iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {self.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {self.elapsed_ms_per_iteration:.1f}",
            f"throughput per GPU (TFLOP/s/GPU): {self.tflops_per_device:.3f}",
            f"tokens per second: {self.tokens_per_s:.1f}",
            f"learning rate: {self.lr:.6E}",
            f"lm loss: {self.lm_loss:.6E}",
            *([f"loss scale: {self.loss_scale:.1f}"] if self.loss_scale is not None else []),
            *([f"moe aux loss: {self.moe_aux_loss:.6E}", f"moe z loss: {self.moe_z_loss:.6E}"]
              if self.moe_aux_loss is not None else []),
            f"grad norm: {self.grad_norm:.3f}",
            f"number of skipped iterations: {self.skipped_iterations:3d}",
            f"number of nan iterations: {self.nan_iterations:3d}",
            *([f"re-run loss / grad norm rel. diff: {self.rerun_loss_rel_diff:.3E} / "
               f"{self.rerun_grad_norm_rel_diff:.3E}"] if self.rerun_loss_rel_diff is not None else []),
        ]
        if self.mfu_bf16 is not None:
            fields.insert(4, f"MFU vs BF16 / FP8 peak: {100 * self.mfu_bf16:.1f}% / {100 * self.mfu_fp8:.1f}%")
        if self.elapsed_s is not None:  # appended: the fields before are Megatron's, in Megatron's order
            fields.append(f"elapsed: {_hms(self.elapsed_s)}")
        if self.eta_s is not None:
            fields.append(f"ETA: {_hms(self.eta_s)}")
        return " " + " | ".join(fields) + " |"

    def json_record(self) -> dict:
        record = asdict(self)
        del record["elapsed_s"], record["eta_s"]
        if self.loss_scale is None:  # the key is --fp16's
            del record["loss_scale"]
        if self.moe_aux_loss is None:  # the keys are --num-experts'
            del record["moe_aux_loss"], record["moe_z_loss"], record["moe_tokens_per_expert"]
        if self.rank_work_ms is None:
            del record["rank_work_ms"]
        if self.rerun_loss_rel_diff is None:  # the keys are --rerun-mode report_stats'
            del record["rerun_loss_rel_diff"], record["rerun_grad_norm_rel_diff"]
        record["comm_bytes"] = {kind: int(self.comm_bytes.get(kind, 0)) for kind in COMM_KINDS}
        return {k: _finite_or_none(v) for k, v in record.items()}


def _hms(seconds: float) -> str:
    """H:MM:SS (hours unbounded), as Megatron-style logs and schedulers print durations."""
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def _finite_or_none(value):
    # JSON has no NaN/inf; a skipped step's loss is written as null instead of a non-standard token.
    return None if isinstance(value, float) and not math.isfinite(value) else value


class TrainingLog:
    """Writes records to `log_dir/metrics.jsonl`, TensorBoard and W&B; each may be absent (not written)."""

    def __init__(self, log_dir: str | None = None, tensorboard_dir: str | None = None):
        self.metrics_path = None
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.metrics_path = Path(log_dir) / "metrics.jsonl"
        self.tensorboard = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # the package is an extra: say which
                raise RuntimeError("--tensorboard-dir needs the `tensorboard` package: pip install tensorboard") from e
            self.tensorboard = SummaryWriter(tensorboard_dir)
        self.wandb = None

    def start_wandb(self, project: str, name: str | None = None, save_dir: str | None = None,
                    config: dict | None = None) -> None:
        """Log the TensorBoard scalars to a W&B run of `project` too (Megatron's `--wandb-project`,
        `--wandb-exp-name`, `--wandb-save-dir`). WANDB_MODE=offline writes the run under `save_dir` only (no
        network; `wandb sync` uploads it later)."""
        try:
            import wandb
        except ImportError as e:  # the parser checks this first; a backstop for other callers
            raise RuntimeError("--wandb-project needs the `wandb` package: pip install wandb") from e
        if save_dir is not None:
            os.makedirs(save_dir, exist_ok=True)  # wandb.init falls back to a temporary directory otherwise
        self.wandb = wandb.init(project=project, name=name, dir=save_dir, config=config)

    def _append(self, record: dict) -> None:
        if self.metrics_path is not None:
            with self.metrics_path.open("a") as f:  # one line per record: a crash loses at most the last one
                f.write(json.dumps(record) + "\n")

    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        """The same tags and values to TensorBoard and W&B."""
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None and scalars:
            self.wandb.log(scalars, step=step)

    def log_iteration(self, record: IterationRecord, fp8_telemetry: dict[str, float] | None = None,
                      histograms: dict[str, torch.Tensor] | None = None) -> None:
        """``fp8_telemetry``: megafp8.fp8.collect_fp8_telemetry's ``{"fp8/<layer>/<role>/<stat>": value}``;
        ``histograms``: collect_block_scale_histograms' block scales (TensorBoard histograms)."""
        kurtosis = {key[len("fp8/"):-len("/input/kurtosis")]: _finite_or_none(value)
                    for key, value in (fp8_telemetry or {}).items() if key.endswith("/input/kurtosis")}
        self._append({**record.json_record(), **({"input_kurtosis": kurtosis} if kurtosis else {})})
        scalars = {f"train/{name}": getattr(record, name) for name in (
            "lm_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "model_state_bytes_per_param",
            *(("moe_aux_loss", "moe_z_loss") if record.moe_aux_loss is not None else ()))}
        # A skipped step's NaN loss or grad norm would break the curves' scale: those points are left out.
        scalars = {tag: value for tag, value in scalars.items() if math.isfinite(value)}
        self._scalars({**scalars, **(fp8_telemetry or {})}, record.iteration)
        if self.tensorboard is not None:
            for tag, values in (histograms or {}).items():
                self.tensorboard.add_histogram(tag, values, record.iteration)

    def log_validation(self, iteration: int, val_lm_loss: float) -> None:
        self._append({"iteration": iteration, "val_lm_loss": _finite_or_none(val_lm_loss)})
        self._scalars({"validation/lm_loss": val_lm_loss}, iteration)

    def log_grad_noise(self, iteration: int, ratio: float) -> None:
        """--fp4-until-grad-noise's probe: the FP4 weight gradients' norm over their quantization noise."""
        self._append({"iteration": iteration, "fp4_grad_noise_ratio": _finite_or_none(ratio)})
        self._scalars({"train/fp4_grad_noise_ratio": ratio}, iteration)

    def log_guard_switch(self, iteration: int, layer: str, saturated: float | None,
                         kurtosis: float | None = None) -> None:
        """The saturation guard moved `layer` to high precision after `iteration` (it saturated `saturated`), or,
        with --fp8-saturation-guard-kurtosis, at its kurtosis warning (`kurtosis`, `saturated` None)."""
        record = {"iteration": iteration, "fp8_guard_switch": layer, "saturated": _finite_or_none(saturated)}
        if kurtosis is not None:
            record["kurtosis"] = _finite_or_none(kurtosis)
        self._append(record)
        if self.tensorboard is not None:
            why = f"input kurtosis {kurtosis:.1f}" if kurtosis is not None else f"{100 * saturated:.2f}% saturated"
            self.tensorboard.add_text("fp8_guard", f"{layer} switched to high precision ({why})", iteration)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
