"""FP8 dot-product attention (--fp8-dot-product-attention): the operands ring attention holds and attends in FP8.

Q, K, V are cast once per forward to the recipe's forward format (E4M3), dO once per backward to its gradient
format (E5M2 under hybrid), each with one scale per tensor: under a delayed recipe the attention's own
ScalingStates' (amax histories updated with the linears' in the step's one amax reduction, checkpointed with them;
current scaling while a state is cold), else a current one from the tensor's amax on the device (no host sync).
P and dS are cast inside the blocks (``megafp8_kernels.fp8_attention_reference``: P with the fixed scale 448, dS
per 64 x 64 tile). Under context parallelism the ring carries each rank's K/V as FP8
bytes with their two scales appended (one message, about half the BF16 bytes), and backward keeps those bytes and
Q's instead of high-precision copies. One context-parallel rank runs the same code as a single diagonal block.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megafp8.fp8.recipe import Fp8Recipe
from megafp8.fp8.scaling_state import ScalingState
from megafp8.fp8.telemetry import Fp8TensorStats
from megafp8_kernels import Granularity, element_format, quantize, resolve_backend
from megafp8_kernels.fp8_attention_reference import fp8_attention_backward, fp8_attention_forward

_SCALE_BYTES = 2 * 4  # K's and V's fp32 scale_inv, appended to the K/V message


@dataclass(frozen=True)
class Fp8AttentionFormats:
    """What the attention casts to: ``forward`` for Q, K, V (and P, always E4M3), ``backward`` for dO and dS."""

    forward: torch.dtype = torch.float8_e4m3fn
    backward: torch.dtype = torch.float8_e5m2
    power_of_2_scale: bool = False

    @classmethod
    def from_recipe(cls, recipe: Fp8Recipe) -> Fp8AttentionFormats:
        return cls(recipe.dtype("input"), recipe.dtype("grad_output"), recipe.power_of_2_scale)


ROLES = ("query", "key", "value", "grad_output")  # the delayed-scaling states of an attention (SelfAttention)


def cast_per_tensor(t: torch.Tensor, dtype: torch.dtype, power_of_2_scale: bool,
                    state: ScalingState | None = None,
                    stats: Callable[[Fp8TensorStats], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data in t's shape, fp32 0-d scale_inv): one scale for the whole tensor, the delayed ``state``'s once it
    is warm (the tensor's amax is then observed for the next update), else the current one from t's amax.
    ``stats``: receives the cast's telemetry (saturated and flushed counts, counted by the cast itself)."""
    given = None if state is None or state.is_cold else state.scale
    q = quantize(t.reshape(-1, t.shape[-1]), dtype, Granularity.TENSORWISE, power_of_2_scale=power_of_2_scale,
                 scale=given, stats=stats is not None)
    if state is not None:
        state.observe(q.amax)
    if stats is not None:
        stats(Fp8TensorStats(q.amax, q.scale_inv, q.counts, t.numel()))
    return q.data.view(t.shape), q.scale_inv.reshape(())


def _kernels(q8: torch.Tensor):
    """(forward, backward): the Triton kernels on a GPU (MEGAFP8_KERNEL_BACKEND as for every kernel) for
    power-of-two head dims >= 16, else the twin."""
    d = q8.shape[-1]
    if resolve_backend(q8.device) == "triton" and d >= 16 and not d & (d - 1):
        from megafp8_kernels.fp8_attention_triton import fp8_attention_backward_triton, fp8_attention_forward_triton

        return fp8_attention_forward_triton, fp8_attention_backward_triton
    return fp8_attention_forward, fp8_attention_backward


class Fp8Blocks:
    """Ring attention's operands in FP8 (``HighPrecisionBlocks``' interface): queries ``(q8, q_inv)``, the K/V
    message ``uint8[K8 bytes, V8 bytes, k_inv, v_inv]``, output gradients ``(dO8, do_inv, delta)``. One instance
    per attention call (it remembers the K/V shape the messages carry). ``states``: the delayed-scaling states by
    role (``ROLES``), or None for current scaling. ``telemetry``: the dict the casts' statistics go to, under
    ``attention_<role>`` (its QKV projection's ``fp8_telemetry``, so the saturation guard counts a saturating
    attention against that layer and moves both to high precision), or None."""

    def __init__(self, formats: Fp8AttentionFormats, states: dict[str, ScalingState] | None = None,
                 telemetry: dict | None = None) -> None:
        self.formats = formats
        self.states = states or {}
        self.telemetry = telemetry
        self.kv_shape: torch.Size | None = None

    def _cast(self, t: torch.Tensor, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.formats.backward if role == "grad_output" else self.formats.forward
        stats = None if self.telemetry is None else lambda s: self.telemetry.__setitem__(f"attention_{role}", s)
        return cast_per_tensor(t, dtype, self.formats.power_of_2_scale, self.states.get(role), stats)

    def queries(self, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._cast(q, "query")

    def pack_kv(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_shape = k.shape
        (k8, k_inv), (v8, v_inv) = self._cast(k, "key"), self._cast(v, "value")
        data = torch.stack([k8, v8]).view(torch.uint8).flatten()
        return torch.cat([data, torch.stack([k_inv, v_inv]).view(torch.uint8)])

    def _unpack(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K8, V8, k_inv, v_inv) views of a K/V message."""
        n = 2 * math.prod(self.kv_shape)
        data = kv[:n].view(self.formats.forward).view(2, *self.kv_shape)
        scales = kv[n:n + _SCALE_BYTES].view(torch.float32)
        return data[0], data[1], scales[0], scales[1]

    def attend(self, queries, kv: torch.Tensor, rows: slice, keys: slice, causal: bool, scale: float):
        q8, q_inv = queries
        k8, v8, k_inv, v_inv = self._unpack(kv)
        return _kernels(q8)[0](q8[..., rows, :], k8[..., keys, :], v8[..., keys, :], q_inv, k_inv, v_inv,
                                   causal, scale)

    def output_grads(self, dout: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # delta = rowsum(dO * O) from the high-precision dO (FlashAttention's preprocessing pass reads it too).
        delta = (dout.float() * out.float()).sum(dim=-1)
        return (*self._cast(dout, "grad_output"), delta)

    def attend_backward(self, grads, queries, kv: torch.Tensor, out, lse, rows: slice, keys: slice, causal: bool,
                        scale: float):
        (do8, do_inv, delta), (q8, q_inv) = grads, queries
        k8, v8, k_inv, v_inv = self._unpack(kv)
        return _kernels(q8)[1](do8[..., rows, :], q8[..., rows, :], k8[..., keys, :], v8[..., keys, :],
                               do_inv, q_inv, k_inv, v_inv, lse[..., rows], delta[..., rows], causal, scale,
                               element_format(self.formats.backward), self.formats.power_of_2_scale)


def fp8_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, formats: Fp8AttentionFormats,
                              scale: float | None = None,
                              states: dict[str, ScalingState] | None = None) -> torch.Tensor:
    """Causal FP8 attention of one rank's whole sequence (no context parallelism): q ``[b, H, s, d]``, k/v
    ``[b, G, s, d]`` (GQA when G < H) in, ``[b, H, s, d]`` in q's dtype out; differentiable. ``states``: delayed
    scaling by role (``ROLES``), or None for current scaling. The model's path with one CP rank."""
    from megafp8.parallel.context_parallel import context_parallel_attention

    return context_parallel_attention(q, k, v, group=None, cp_rank=0, cp_size=1, enable_gqa=q.shape[1] != k.shape[1],
                                      scale=scale, blocks=Fp8Blocks(formats, states))
