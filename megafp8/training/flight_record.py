"""Flight records of suspicious steps: one JSON file per event under --log-dir/flight_records/, and the hooks that
find, during a step's re-run, the first module whose output (or the gradient arriving at it) went non-finite."""
from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

RECORDS_DIR = "flight_records"


class NonFiniteFinder:
    """Forward hooks on every module of this rank's model chunks (``model``: global module names, as the FP8
    telemetry tags) for one re-run: the first module, in execution order, whose output is non-finite, with the
    micro-batch and the batch rows (samples) where it is, or whose output's gradient is (whichever comes first).
    Each check reads the device: for a re-run only, never for a normal step."""

    def __init__(self, model: nn.Module, micro_batches: list[list[int]]) -> None:
        self.micro_batches = micro_batches
        self.finding: dict | None = None
        self.order = 0  # modules seen, so findings of one rank sort in execution order
        self._calls: dict[str, int] = {}
        self._handles = [module.register_forward_hook(functools.partial(self._forward, name))
                         for name, module in model.named_modules() if name]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _forward(self, name: str, module: nn.Module, args: tuple, output) -> None:
        tensor = output if isinstance(output, torch.Tensor) else (
            output[0] if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) else None)
        if tensor is None or not tensor.is_floating_point() or not torch.is_grad_enabled():
            return
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        self.order += 1
        if self.finding is not None:
            return
        bad = ~torch.isfinite(tensor.detach())
        if bool(bad.any()):
            self.finding = self._describe(name, "forward", call, bad)
        elif tensor.requires_grad:
            tensor.register_hook(functools.partial(self._backward, name, call))

    def _backward(self, name: str, call: int, grad: torch.Tensor) -> None:
        if self.finding is None and grad is not None and not bool(torch.isfinite(grad).all()):
            self.finding = self._describe(name, "backward", call, ~torch.isfinite(grad))

    def _describe(self, name: str, which: str, call: int, bad: torch.Tensor) -> dict:
        finding = {"module": name, "pass": which, "micro_batch": call, "order": self.order}
        if bad.dim() == 3:  # [seq, batch, hidden]: the batch rows, and so the samples, that hold a non-finite value
            rows = bad.any(dim=2).any(dim=0).nonzero().flatten().tolist()
            samples = self.micro_batches[call] if call < len(self.micro_batches) else []
            finding["rows"] = rows
            finding["samples"] = [samples[r] for r in rows if r < len(samples)]
        return finding


def first_nonfinite(per_rank: list[dict]) -> dict | None:
    """Where the step first went non-finite, from every rank's finding: a forward finding on the earliest pipeline
    stage (activations flow up the stages), else a backward one on the latest (gradients flow down)."""
    forward = [r for r in per_rank if r.get("finding") and r["finding"]["pass"] == "forward"]
    if forward:
        best = min(forward, key=lambda r: (r["coords"]["pp"], r["finding"]["order"], r["rank"]))
    else:
        backward = [r for r in per_rank if r.get("finding")]
        if not backward:
            return None
        best = min(backward, key=lambda r: (-r["coords"]["pp"], r["finding"]["order"], r["rank"]))
    return {"rank": best["rank"], **{k: v for k, v in best["finding"].items() if k != "order"}}


def gather_to_all(value) -> list:
    """Every rank's ``value`` (a rare path: one object all-gather over the world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf": JSON has no such numbers, and a record must say which it was
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_flight_record(log_dir: str, record: dict) -> Path:
    """``log_dir/flight_records/iter_NNNNNNN.json`` (a second event at the same iteration gets a suffix)."""
    directory = Path(log_dir) / RECORDS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"iter_{record['iteration']:07d}.json"
    suffix = 1
    while path.exists():
        path = directory / f"iter_{record['iteration']:07d}_{suffix}.json"
        suffix += 1
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(_json_safe(record), indent=1, sort_keys=False) + "\n")
    os.replace(temporary, path)
    return path


def read_flight_records(log_dir: str | Path) -> list[dict]:
    """The run's flight records, in iteration order (none: an empty list)."""
    directory = Path(log_dir) / RECORDS_DIR
    if not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob("iter_*.json")):
        try:
            records.append({**json.loads(path.read_text()), "file": path.name})
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable flight record ({e})") from e
    return sorted(records, key=lambda r: (r.get("iteration", 0), r["file"]))
