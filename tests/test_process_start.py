"""What a training process imports before its first step: an FP8 run that neither compiles nor checkpoints loads
neither torch._dynamo (torch's custom ops would import it on their first call: kernels/custom_op_startup.py) nor
torch.distributed.checkpoint (megafp8.checkpoint loads its modules on use), ~1 s of each rank's start; a run that
saves loads the latter, and a custom op called once dynamo is loaded runs under torch's dynamo.disable wrapper."""
import subprocess
import sys
import types

import torch

from data_fixtures import REPO_ROOT
from megafp8.training.megatron_flags import LLAMA_FLAGS
from megafp8_kernels.custom_op_startup import _dynamo_disabled_once_loaded

WATCHED = ("torch._dynamo", "torch.distributed.checkpoint")
RUN_AND_REPORT = """
import atexit, runpy, sys
atexit.register(lambda: print("LOADED", *[m for m in %r if m in sys.modules]))
sys.argv = ["megafp8.pretrain", *sys.argv[1:]]
runpy.run_module("megafp8.pretrain", run_name="__main__")
""" % (WATCHED,)
FP8_RUN = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-layers", "1",
           "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
           "--train-iters", "2", "--mock-data", "--eval-iters", "0", "--fp8-format", "hybrid", "--fp8-recipe",
           "delayed"]


def _loaded(*flags: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", RUN_AND_REPORT, *FP8_RUN, *flags], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("LOADED"))
    return line.split()[1:]


def test_an_fp8_run_starts_without_dynamo_or_dcp_and_a_saving_run_loads_dcp(tmp_path):
    assert _loaded() == []
    assert _loaded("--save", str(tmp_path / "ckpt")) == ["torch.distributed.checkpoint"]


def test_the_backend_runs_under_dynamo_disable_once_dynamo_is_loaded(monkeypatch):
    calls = []

    def backend(x):
        calls.append("backend")
        return x + 1

    def disable(fn, recursive=True):
        calls.append("disable")
        return lambda *args: (calls.append("disabled"), fn(*args))[1]

    call = _dynamo_disabled_once_loaded(backend)
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    assert call(torch.ones(1)).item() == 2 and calls == ["backend"]
    monkeypatch.setitem(sys.modules, "torch._dynamo", types.SimpleNamespace(disable=disable))
    call(torch.ones(1))
    call(torch.ones(1))
    assert calls == ["backend", "disable", "disabled", "backend", "disabled", "backend"]  # the wrapper built once
