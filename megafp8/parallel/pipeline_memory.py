"""Saved-activation accounting: the bytes autograd keeps for backward, live and at their peak, measured from
the tensors it actually saves (``torch.autograd.graph.saved_tensors_hooks``), on any device.

Each saved tensor is charged by its storage (a view holds its whole storage alive), once per storage
however often it is saved, until the last autograd node holding it is freed. Storages of the given
modules' parameters and buffers (weights, RoPE tables) are not activations and are not charged. The
inputs of a recomputed region count (``megafp8.model.recompute`` saves them like Megatron does); the
activations inside it do not, until backward recomputes them.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class _Saved:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: tuple | None, meter: "SavedActivationMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return t.device.type, t.device.index, storage.data_ptr(), storage.nbytes()


class SavedActivationMeter:
    """``with SavedActivationMeter(modules) as meter: ...`` then ``meter.peak_bytes`` / ``meter.live_bytes``."""

    def __init__(self, modules: Iterable[nn.Module] = ()) -> None:
        self._excluded = {_storage_key(t) for m in modules for t in (*m.parameters(), *m.buffers())}
        self._refs: dict[tuple, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Saved:
        key = _storage_key(t)
        if key in self._excluded or key[2] == 0:
            return _Saved(t, None, self)
        if key not in self._refs:
            self.live_bytes += key[3]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: tuple) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live_bytes -= key[3]

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
