"""No host sync in a training iteration that does not log: the training entry run in this process, every
`aten::_local_scalar_dense` (.item(), float(t), bool(t)) and every Tensor.tolist()/.cpu()/.numpy() counted per
iteration. Iterations 2 and 3 (of 4, logging every 4) must count 0; the log iteration reads one packed tensor.
FP8 runs with the saturation guard on (the default: its strikes stay on the device between log iterations) and off."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from data_fixtures import small_corpus, sp_model, text_prefix  # noqa: F401 (fixtures)
from megafp8 import pretrain
from megafp8.training import train as train_module

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--train-iters", "4",
         "--log-interval", "4", "--eval-iters", "0", "--use-distributed-optimizer", "--clip-grad", "1.0"]


class _HostReads(TorchDispatchMode):
    """Counts device->host reads per training iteration (``iteration`` set by the patched train_step)."""

    def __init__(self):
        super().__init__()
        self.iteration, self.reads = 0, {}

    def count(self, what: str) -> None:
        self.reads.setdefault(self.iteration, []).append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]


@pytest.mark.parametrize("flags", [[], FP8, [*FP8, "--no-fp8-saturation-guard"]],
                         ids=["bf16", "fp8-delayed-guard-on", "fp8-delayed-guard-off"])
def test_a_non_logging_iteration_reads_nothing_from_the_device(text_prefix, tmp_path, monkeypatch, flags):
    prefix, tokenizer = text_prefix
    reads = _HostReads()
    original_step = train_module.Trainer.train_step

    def train_step(self):
        reads.iteration = self.progress.iteration + 1
        return original_step(self)

    monkeypatch.setattr(train_module.Trainer, "train_step", train_step)
    for name in ("tolist", "cpu", "numpy"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _m=method, _n=name, **k: (reads.count(_n), _m(self, *a, **k))[1])
    with reads:
        status = pretrain.main([*MODEL, *flags, "--data-path", prefix, "--tokenizer-model", tokenizer,
                                "--log-dir", str(tmp_path / "logs")])
    assert status == 0
    assert reads.reads.get(2, []) == [] and reads.reads.get(3, []) == [], reads.reads
    assert reads.reads[4].count("tolist") >= 1  # the log iteration: the packed counters, loss and grad norm
