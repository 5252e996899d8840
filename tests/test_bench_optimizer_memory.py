"""tools/bench/bench_optimizer_memory.py: its live-bytes tracker counts what ops allocate (not views, not in-place
results, not persistent tensors; on one device type if asked) until freed, and --quick prints one row per preset x
--fp8-param-gather."""
import os
import subprocess
import sys

import torch

from data_fixtures import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "bench"))
from bench_optimizer_memory import LiveBytes  # noqa: E402


def test_live_bytes_counts_allocations_until_freed():
    persistent = torch.zeros(4096)
    mode = LiveBytes()
    with mode:
        a = persistent * 2            # 16 KiB
        view = a.view(64, 64)         # nothing new
        persistent.add_(1)            # in place on a tensor from outside: nothing
        b = a + 1                     # 16 KiB more: peak 32 KiB
        del a, view
        c = b[:1024].clone()          # 4 KiB, after a went: 20 KiB live
        del b
    assert mode.peak == 2 * 4096 * 4 and mode.live == 1024 * 4
    del c
    assert mode.live == 0


def test_live_bytes_counts_only_the_device_type_asked():
    mode = LiveBytes(device_type="cpu")
    with mode:
        on_cpu = torch.zeros(1024)                          # 4 KiB
        elsewhere = torch.empty(1 << 20, device="meta").copy_(torch.ones(1 << 20))  # no CPU bytes kept
    assert mode.peak == 1024 * 4 + (1 << 20) * 4 and mode.live == 1024 * 4  # torch.ones: a CPU temporary
    del on_cpu, elsewhere
    assert mode.live == 0


def test_quick_table():
    result = subprocess.run([sys.executable, "tools/bench/bench_optimizer_memory.py", "--quick"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| fp32") or
            line.startswith("| compressed")]
    assert [(r[0][2:], r[1]) for r in rows] == [(p, g) for p in ("fp32", "compressed")
                                                for g in ("off", "delayed", "blockwise")]
    for r in rows:
        mib, per_element = (float(x) for x in r[4].split(", "))
        assert 0 < mib and 4 < per_element < 200  # at least the fp32 update itself, at most a few dozen temporaries
        assert (r[5] == "- |") == (r[1] == "off")
