"""Run reports: the console line has Megatron's fields in order, metrics.jsonl has exactly the contract's
keys (JSON-valid even for a skipped step), and TensorBoard scalars read back with tensorboard's own reader."""
import json

import pytest

from megafp8.parallel.collectives import COMM_KINDS
from megafp8.training.training_log import IterationRecord, TrainingLog, device_peak_tflops

CONTRACT_KEYS = {"iteration", "lm_loss", "grad_norm", "lr", "tokens_per_s", "skipped_iterations", "comm_bytes",
                 "model_state_bytes_per_param"}


def _record(iteration: int, loss: float = 2.5) -> IterationRecord:
    return IterationRecord(iteration=iteration, train_iters=100, consumed_samples=16 * iteration, lm_loss=loss,
                           grad_norm=0.75, lr=3e-4, tokens_per_s=1234.5, skipped_iterations=0, nan_iterations=0,
                           elapsed_ms_per_iteration=12.0, tflops_per_device=0.5,
                           comm_bytes={"tp_sp_allgather": 100, "amax_reduce": 8}, model_state_bytes_per_param=6.5)


def test_console_line_has_megatron_fields_in_order():
    line = _record(10).console_line()
    order = ["iteration       10/     100", "consumed samples:", "elapsed time per iteration (ms): 12.0",
             "throughput per GPU (TFLOP/s/GPU): 0.500", "tokens per second: 1234.5", "learning rate: 3.000000E-04",
             "lm loss: 2.500000E+00", "grad norm: 0.750", "number of skipped iterations:   0",
             "number of nan iterations:   0"]
    positions = [line.index(field) for field in order]
    assert positions == sorted(positions) and line.rstrip().endswith("|")


def test_metrics_jsonl_keys_and_nan_as_null(tmp_path):
    log = TrainingLog(log_dir=str(tmp_path))
    log.log_iteration(_record(1))
    log.log_iteration(_record(2, loss=float("nan")))
    log.log_validation(2, 2.25)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert CONTRACT_KEYS <= set(records[0]) and set(records[0]["comm_bytes"]) == set(COMM_KINDS)
    assert records[0]["comm_bytes"]["tp_sp_allgather"] == 100 and records[0]["comm_bytes"]["pp_p2p"] == 0
    assert records[1]["lm_loss"] is None
    assert records[2] == {"iteration": 2, "val_lm_loss": 2.25}


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TrainingLog(tensorboard_dir=str(tmp_path))
    for i in (1, 2):
        log.log_iteration(_record(i, loss=3.0 - i), fp8_telemetry={"fp8/layers.0.mlp.linear_fc1/input/amax": 4.0})
    log.log_validation(2, 1.5)
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.value for e in events.Scalars("train/lm_loss")] == [2.0, 1.0]
    assert events.Scalars("validation/lm_loss")[0].value == 1.5
    assert events.Scalars("fp8/layers.0.mlp.linear_fc1/input/amax")[0].value == 4.0


def test_mfu_peaks():
    assert device_peak_tflops("NVIDIA H200") == (989.0, 1979.0)
    assert device_peak_tflops("cpu") is None
    line = IterationRecord(**{**_record(1).__dict__, "mfu_bf16": 0.4, "mfu_fp8": 0.2}).console_line()
    assert "MFU vs BF16 / FP8 peak: 40.0% / 20.0%" in line


def test_elapsed_and_eta_are_appended_after_megatrons_fields_and_stay_out_of_metrics(tmp_path):
    record = IterationRecord(**{**_record(10).__dict__, "elapsed_s": 3725.4, "eta_s": 59.6})
    line = record.console_line()
    assert line.endswith(" | number of nan iterations:   0 | elapsed: 1:02:05 | ETA: 0:01:00 |"), line
    assert "elapsed" not in _record(10).console_line().split("nan iterations")[1]  # absent when not measured
    log = TrainingLog(log_dir=str(tmp_path))
    log.log_iteration(record)
    assert not {"elapsed_s", "eta_s"} & set(json.loads((tmp_path / "metrics.jsonl").read_text()))
