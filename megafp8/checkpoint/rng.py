"""Every random-number generator state a bit-exact resume needs: python, numpy, torch CPU, CUDA (all
devices, when initialized) and megafp8's model-parallel RNG tracker. States are per rank."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state(tracker: Any | None = None) -> dict[str, Any]:
    """This rank's generator states; ``tracker``: a ``megafp8.parallel.random.ModelParallelRNG`` or None."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if tracker is not None:
        state["model_parallel"] = tracker.state_dict()
    return state


def restore_rng_state(state: dict[str, Any], tracker: Any | None = None) -> None:
    """Inverse of ``capture_rng_state``. The tracker's states are restored before the default
    generators, since its ``load_state_dict`` also sets them (to the same values)."""
    if tracker is not None and "model_parallel" in state:
        tracker.load_state_dict(state["model_parallel"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
