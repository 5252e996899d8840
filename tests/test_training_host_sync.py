"""No host sync in a training iteration that does not log: the training entry with every device->host read and
host->device copy counted per iteration (host_sync_counting.py). Iterations 2 and 3 (of 4, logging every 4) must
count 0; the log iteration reads one packed tensor. FP8 runs with the saturation guard on (the default: its strikes
stay on the device between log iterations) and off; run in this process (`python -m megafp8.pretrain`) and the way
examples/pretrain_single_gpu.sh launches (`torchrun --standalone --nproc-per-node 1`: a one-process group), where the
stop decision must need no collective and no device read."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_fixtures import small_corpus, sp_model, text_prefix  # noqa: F401 (fixtures)
from host_sync_counting import FP8, MODEL, HostReads
from megafp8 import pretrain

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("flags", [[], FP8, [*FP8, "--no-fp8-saturation-guard"]],
                         ids=["bf16", "fp8-delayed-guard-on", "fp8-delayed-guard-off"])
def test_a_non_logging_iteration_reads_nothing_from_the_device(text_prefix, tmp_path, flags):
    prefix, tokenizer = text_prefix
    reads = HostReads()
    undo = reads.install()
    try:
        with reads:
            status = pretrain.main([*MODEL, *flags, "--data-path", prefix, "--tokenizer-model", tokenizer,
                                    "--log-dir", str(tmp_path / "logs")])
    finally:
        undo()
    assert status == 0
    reads.assert_quiet_between_logs()
    assert reads.reads[4].count("tolist") >= 1  # the log iteration: the packed counters, loss and grad norm


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [[], FP8], ids=["bf16", "fp8-delayed"])
def test_single_gpu_launch_under_torchrun_reads_nothing_between_logs(text_prefix, tmp_path, flags):
    """torchrun's one worker initializes a process group: the stop decision (a signal, --exit-duration-in-mins)
    is then still a host-side fact, with no collective and no device read per iteration."""
    prefix, tokenizer = text_prefix
    out = tmp_path / "reads.json"
    env = {**os.environ, "HOST_SYNC_PROBE_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                             str(TESTS / "host_sync_probe.py"), *MODEL, *flags, "--data-path", prefix,
                             "--tokenizer-model", tokenizer, "--exit-duration-in-mins", "60"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reads = HostReads()
    reads.reads = {int(k): v for k, v in json.loads(out.read_text()).items()}
    reads.assert_quiet_between_logs()
    assert reads.reads[4].count("tolist") >= 1


def test_logged_time_per_iteration_includes_the_wait_for_the_device(text_prefix, tmp_path, monkeypatch):
    """On a GPU the host runs ahead and the log iteration's read is where it waits for the window's steps: the
    time per iteration must be taken after that read. Here the read is made to take 2 s (a device still busy)."""
    import time

    from megafp8.training import train as train_module

    prefix, tokenizer = text_prefix
    original_read = train_module.Trainer._read_counters

    def slow_read(trainer, *scalars):
        if scalars:  # the log iteration's read
            time.sleep(2.0)
        return original_read(trainer, *scalars)

    monkeypatch.setattr(train_module.Trainer, "_read_counters", slow_read)
    assert pretrain.main([*MODEL, "--data-path", prefix, "--tokenizer-model", tokenizer,
                          "--log-dir", str(tmp_path / "logs")]) == 0
    record = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    tokens_per_iteration = 4 * 32
    assert record["tokens_per_s"] <= tokens_per_iteration / (2.0 / 4), record  # the 2 s over 4 iterations counted
