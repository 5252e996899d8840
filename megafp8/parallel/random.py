"""Randomness that does not depend on the parallel layout: per-parameter seeded initialization, and the
model-parallel RNG for random ops inside tensor-parallel regions (Megatron's CudaRNGStatesTracker idea).

**Initialization.** Every parameter is drawn *as a whole* (its full TP=1 shape) from a generator seeded
by ``(seed, global parameter name)`` and then cut to this rank's shard with the parameter's sharding
tags (``partition_dim``, ``partition_stride``, ``padded_vocab``). The same ``--seed`` therefore gives
the same full model under any TP/PP layout, and the shards of one tensor always differ. Tensors are
drawn one at a time, so the peak extra memory is one full (fp32) tensor. The draw happens on the
parameter's device: a CPU and a CUDA run with one seed give different (equally valid) models.

Vocab padding rows (embedding / output head rows at or past the real vocab, whose count depends on
TP) are zero, as ``sharding.resize_vocab_dim`` pads a converted checkpoint: they are never looked up
and their logits are masked out of the loss, so zero keeps the full model identical under every TP.

**Model-parallel RNG.** Dropout-like randomness inside a TP region must differ between TP ranks (each
holds different channels) but be identical across them outside (replicated activations).
``ModelParallelRNG.fork()`` swaps in a per-TP-rank CPU+CUDA generator state for the duration of a
``with`` block; outside it the default generators are seeded identically on every TP rank.
Its states are saved in checkpoints (``state_dict`` / ``load_state_dict``).
"""
from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from megafp8.parallel.sharding import shard_tensor

InitMethod = Callable[[torch.Tensor, "torch.Generator | None"], object]

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offsets: the TP-rank stream and the per-pipeline-stage default stream stay distinct from
# the plain seed, so a user seed never reproduces another stream.
_TP_SEED_OFFSET = 2718
_PP_SEED_STRIDE = 100


@dataclass(frozen=True)
class NormalInit:
    """N(0, std), drawn from ``generator`` (None: the device's default generator). A dataclass rather
    than a closure so parameters that carry it stay picklable."""

    std: float

    def __call__(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return nn.init.normal_(tensor, mean=0.0, std=self.std, generator=generator)


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a global parameter name (stable across processes and runs)."""
    digest = hashlib.sha256(f"{int(seed)}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def parameter_generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(parameter_seed(seed, name))


def full_shape(param: torch.Tensor, tp_size: int) -> list[int]:
    """The TP=1 shape of ``param`` (its local shard) from its sharding tags."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


def draw_full_tensor(param: torch.Tensor, init_method: InitMethod, generator: torch.Generator | None,
                     tp_size: int, vocab_size: int | None = None) -> torch.Tensor:
    """``param``'s full tensor (fp32, on its device). Vocab-padded tensors: only the first
    ``vocab_size`` rows along the vocab dim are drawn (a layout-independent shape), the rest are zero."""
    shape = full_shape(param, tp_size)
    full = torch.zeros(shape, dtype=torch.float32, device=param.device)
    if getattr(param, "padded_vocab", False) and vocab_size is not None:
        dim = param.partition_dim
        if vocab_size > shape[dim]:
            raise ValueError(f"vocab size {vocab_size} exceeds the padded vocab ({shape[dim]}) of a parameter")
        drawn = torch.empty([*shape[:dim], vocab_size, *shape[dim + 1:]], dtype=torch.float32, device=param.device)
        init_method(drawn, generator)
        full.narrow(dim, 0, vocab_size).copy_(drawn)
    else:
        init_method(full, generator)
    return full


@torch.no_grad()
def initialize_parameter_(param: torch.Tensor, init_method: InitMethod, tp_rank: int, tp_size: int, *,
                          generator: torch.Generator | None = None, vocab_size: int | None = None) -> None:
    """Draw ``param``'s full tensor and copy this TP rank's shard of it into ``param``."""
    full = draw_full_tensor(param, init_method, generator, tp_size, vocab_size)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        full = shard_tensor(full, tp_size, tp_rank, param.partition_dim, param.partition_stride)
    param.copy_(full)


def set_init_method(param: nn.Parameter, init_method: InitMethod) -> None:
    """Remember how ``param`` is initialized, for ``initialize_parameters`` (Megatron keeps it in the layer)."""
    param.init_method = init_method


@torch.no_grad()
def initialize_parameters(module: nn.Module, seed: int, tp_rank: int, tp_size: int, *,
                          vocab_size: int | None = None, aliases: Mapping[str, str] | None = None) -> list[str]:
    """Initialize every parameter of ``module`` that carries an ``init_method`` from the generator of
    ``(seed, name)``, full tensor then this rank's shard, one tensor at a time.

    ``aliases`` maps a parameter name to the name whose values it must share (the last pipeline stage's
    copy of a tied embedding is drawn as ``embedding.weight``). Parameters without ``init_method``
    (norm weights = 1, biases = 0) are deterministic already. Returns the names initialized.
    """
    aliases = aliases or {}
    done = []
    for name, param in module.named_parameters():
        init_method = getattr(param, "init_method", None)
        if init_method is None or param.device.type == "meta":
            continue
        generator = parameter_generator(seed, aliases.get(name, name), param.device)
        initialize_parameter_(param, init_method, tp_rank, tp_size, generator=generator, vocab_size=vocab_size)
        done.append(name)
    return done


# ---- model-parallel RNG -------------------------------------------------------------------------------

def _device_rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_device_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seeded_state(seed: int) -> dict[str, torch.Tensor]:
    """The CPU (+ current CUDA device) generator states after ``manual_seed(seed)``, without disturbing
    the current ones."""
    saved = _device_rng_state()
    try:
        torch.manual_seed(seed)
        return _device_rng_state()
    finally:
        _set_device_rng_state(saved)


class ModelParallelRNG:
    """Named generator states swapped in by ``fork(name)``; the default generators are left for the
    randomness that must agree across TP ranks.

    ``add(name, seed)`` registers a state; ``fork`` swaps it in for the CPU and the current CUDA
    device, runs the block, stores the advanced state back and restores the outer state, so a
    forked region consumes nothing from the default stream.
    """

    def __init__(self) -> None:
        self._states: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"ModelParallelRNG: state {name!r} already exists")
        self._states[name] = _seeded_state(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self._states:
            raise KeyError(f"ModelParallelRNG: no state {name!r}; call model_parallel_seed() first")
        outer = _device_rng_state()
        _set_device_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _device_rng_state()
            _set_device_rng_state(outer)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Tracked states plus the default generators' (``"default"``), for checkpoints."""
        states = {name: dict(state) for name, state in self._states.items()}
        states["default"] = _device_rng_state()
        return states

    def load_state_dict(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        states = dict(states)
        default = states.pop("default", None)
        self._states = {name: dict(state) for name, state in states.items()}
        if default is not None:
            _set_device_rng_state(default)


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0) -> ModelParallelRNG:
    """Seed the default CPU/CUDA generators identically across TP (and DP) ranks, distinct per pipeline
    stage, and return a tracker whose ``fork()`` stream is distinct per TP rank (Megatron's offsets)."""
    stage_seed = seed + _PP_SEED_STRIDE * pp_rank
    torch.manual_seed(stage_seed)
    rng = ModelParallelRNG()
    rng.add(MODEL_PARALLEL_RNG, stage_seed + _TP_SEED_OFFSET + tp_rank)
    return rng
