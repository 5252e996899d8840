"""Randomness that does not depend on the parallel layout: per-parameter seeded initialization, and the
model-parallel RNG for random ops inside tensor-parallel regions (Megatron's CudaRNGStatesTracker idea).

**Initialization.** Every parameter is drawn *as a whole* (its full TP=1 shape) from a generator seeded
by ``(seed, global parameter name)`` and then cut to this rank's shard with the parameter's sharding
tags (``partition_dim``, ``partition_stride``, ``padded_vocab``). The same ``--seed`` therefore gives
the same full model under any TP/PP layout, and the shards of one tensor always differ. Tensors are
drawn one at a time, so the peak extra memory is one full (fp32) tensor (none when the parameter is its
own full fp32 tensor: it is drawn in place). The draw happens on the parameter's device: a CPU and a CUDA
run with one seed give different (equally valid) models, and every layout of one device type the same.

**Building on the target device.** Under ``build_on_device(device)`` a model is built without a host copy
and without a throw-away draw: ``torch.empty`` (what a layer allocates a weight with, values to come) makes
meta tensors, every other factory call (norm weights' ones, RoPE tables, FP8 scaling buffers) lands on
``device`` directly, and ``initialize_parameters`` then gives each meta parameter its storage on ``device``
and draws it there, one parameter at a time. The values equal those of a model built on ``device`` without
the context.

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
import contextvars
import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from megafp8.parallel.placement import placement_of, shard_coords
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


def _draw_into_(full: torch.Tensor, param: torch.Tensor, init_method: InitMethod,
                generator: torch.Generator | None, vocab_size: int | None) -> None:
    """Fill ``full`` (``param``'s full shape, fp32): drawn, with vocab-padding rows at zero."""
    if getattr(param, "padded_vocab", False) and vocab_size is not None:
        dim = param.partition_dim
        if vocab_size > full.shape[dim]:
            raise ValueError(f"vocab size {vocab_size} exceeds the padded vocab ({full.shape[dim]}) of a parameter")
        real = full.narrow(dim, 0, vocab_size)
        if real.is_contiguous():  # the usual vocab dim 0: the same values as a separate [vocab_size, ...] draw
            init_method(real, generator)
        else:  # only the first vocab_size rows are drawn, whatever the layout: a layout-independent shape
            real.copy_(init_method(torch.empty(real.shape, dtype=torch.float32, device=full.device), generator))
        full.narrow(dim, vocab_size, full.shape[dim] - vocab_size).zero_()
    else:
        init_method(full, generator)


def draw_full_tensor(param: torch.Tensor, init_method: InitMethod, generator: torch.Generator | None,
                     tp_size: int, vocab_size: int | None = None) -> torch.Tensor:
    """``param``'s full tensor (fp32, on its device). Vocab-padded tensors: only the first
    ``vocab_size`` rows along the vocab dim are drawn (a layout-independent shape), the rest are zero."""
    full = torch.empty(full_shape(param, tp_size), dtype=torch.float32, device=param.device)
    _draw_into_(full, param, init_method, generator, vocab_size)
    return full


@torch.no_grad()
def initialize_parameter_(param: torch.Tensor, init_method: InitMethod, tp_rank: int, tp_size: int, *,
                          generator: torch.Generator | None = None, vocab_size: int | None = None) -> None:
    """Draw ``param``'s full tensor and copy this TP rank's shard of it into ``param``."""
    sharded = getattr(param, "tensor_model_parallel", False) and tp_size > 1
    if not sharded and param.dtype == torch.float32 and param.is_contiguous():
        _draw_into_(param, param, init_method, generator, vocab_size)  # its own full tensor: no temporary
        return
    full = draw_full_tensor(param, init_method, generator, tp_size, vocab_size)
    if sharded:
        full = shard_tensor(full, tp_size, tp_rank, param.partition_dim, param.partition_stride)
    param.copy_(full)


def set_init_method(param: nn.Parameter, init_method: InitMethod) -> None:
    """Remember how ``param`` is initialized, for ``initialize_parameters`` (Megatron keeps it in the layer)."""
    param.init_method = init_method


class _UninitializedOnMeta(TorchFunctionMode):
    """``torch.empty`` without a device makes a meta tensor: values that are still to come cost no memory.
    A tensor that has values and is sent to meta (a module moving its buffers to its meta weight's device,
    as the FP8 layers do with their scaling states) stays on ``device`` instead: meta would lose them."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.empty, torch.empty_strided) and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        elif func is torch.Tensor.to and args[0].device.type != "meta":
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "meta":
                return args[0].to(self.device, dtype, non_blocking=non_blocking,
                                  memory_format=memory_format or torch.preserve_format)
        return func(*args, **kwargs)


def _materialize_(param: nn.Parameter, device: torch.device) -> None:
    """Give meta ``param`` uninitialized storage on ``device``, keeping the Parameter object (others may hold
    it) and its tags (``.data =`` refuses a meta -> real device change)."""
    real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
    real.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, real)


_BUILD_DEVICE: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("build_device", default=None)


@contextlib.contextmanager
def build_on_device(device: torch.device | str) -> Iterator[None]:
    """Build a model directly on ``device`` (module docstring): weights are meta until
    ``initialize_parameters`` (GPTModel calls it last) gives each its storage on ``device`` and draws it
    there; everything else is created on ``device`` (like ``with torch.device(device)``)."""
    device = torch.device(device)
    token = _BUILD_DEVICE.set(device)
    try:
        with torch.device(device), _UninitializedOnMeta(device):
            yield
    finally:
        _BUILD_DEVICE.reset(token)


@torch.no_grad()
def initialize_parameters(module: nn.Module, seed: int, tp_rank: int, tp_size: int, *,
                          vocab_size: int | None = None, aliases: Mapping[str, str] | None = None,
                          group_coords: Mapping[str, tuple[int, int]] | None = None) -> list[str]:
    """Initialize every parameter of ``module`` that carries an ``init_method`` from the generator of
    ``(seed, name)``, full tensor then this rank's shard, one tensor at a time.

    ``aliases`` maps a parameter name to the name whose values it must share (the last pipeline stage's
    copy of a tied embedding is drawn as ``embedding.weight``). Parameters without ``init_method``
    (norm weights = 1, biases = 0) are deterministic already. Meta parameters are skipped, except under
    ``build_on_device``: there each gets its storage on the build device first (none on "meta", where the
    build is shapes only: tools/bench/bench_host_overhead.py). A parameter whose placement splits it over another
    group than TP (an expert over ETP) takes its shard by its (rank, size) in ``group_coords``
    (ParallelState.group_coordinates()). Returns the names initialized.
    """
    aliases = aliases or {}
    build_device = _BUILD_DEVICE.get()
    if build_device is not None and build_device.type == "meta":  # a shapes-only build: nothing has values
        return []
    done = []
    for name, param in module.named_parameters():
        init_method = getattr(param, "init_method", None)
        if param.device.type == "meta":
            if build_device is None:
                continue
            if init_method is None:
                raise ValueError(f"parameter {name!r} was allocated with torch.empty but has no init_method, so "
                                 "nothing gives it values under build_on_device: set one (set_init_method) or "
                                 "create it with its values (torch.ones, torch.zeros)")
            _materialize_(param, build_device)
        elif init_method is None:
            continue
        generator = parameter_generator(seed, aliases.get(name, name), param.device)
        rank, size = shard_coords(placement_of(param), tp_rank, tp_size, group_coords)
        initialize_parameter_(param, init_method, rank, size, generator=generator, vocab_size=vocab_size)
        done.append(name)
    if build_device is not None:
        uninitialized = [name for name, buffer in module.named_buffers() if buffer.device.type == "meta"]
        if uninitialized:
            raise ValueError(f"buffers {uninitialized} were allocated with torch.empty under build_on_device and "
                             "have no values: create them with their values (torch.zeros, torch.full, ...)")
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


def model_parallel_rng(seed: int, tp_rank: int, pp_rank: int = 0) -> ModelParallelRNG:
    """A tracker whose ``fork()`` stream is distinct per TP rank and pipeline stage (Megatron's offsets), leaving
    the default generators as they are (what a model builds for its dropout when it is given no tracker)."""
    rng = ModelParallelRNG()
    rng.add(MODEL_PARALLEL_RNG, seed + _PP_SEED_STRIDE * pp_rank + _TP_SEED_OFFSET + tp_rank)
    return rng


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0) -> ModelParallelRNG:
    """Seed the default CPU/CUDA generators identically across TP (and DP) ranks, distinct per pipeline
    stage, and return a tracker whose ``fork()`` stream is distinct per TP rank (Megatron's offsets)."""
    torch.manual_seed(seed + _PP_SEED_STRIDE * pp_rank)
    return model_parallel_rng(seed, tp_rank, pp_rank)
