"""Quantizer: how one tensor role is quantized for one GEMM (format, scale layout, scale rule), including the parts
that depend on the layout when the tensor is sharded along the sequence. The linear op asks a recipe for quantizers
and never branches on a format itself."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from megafp8_kernels import BLOCK, ElementFormat, Granularity, QuantizedTensor, ScaleLayout, quantize, scale_from_amax
from megafp8_kernels.formats import BLOCK_1X128, PER_ROW, PER_TENSOR
from megafp8_kernels.scaling import layout_granularity

if TYPE_CHECKING:
    from .linear_function import SequenceParallelComm
    from .prologue import InputPrologue


class TransposedShard(NamedTuple):
    """This rank's columns of a sequence-sharded tensor's transposed copy: its payload, the scales of the whole copy,
    and the per-tensor decode scale of a two-level format (NVFP4), else None."""

    data_t: torch.Tensor
    scale_inv_t: torch.Tensor
    global_scale_inv_t: torch.Tensor | None = None


class Quantized(NamedTuple):
    """A quantizer's result: the operand, the amax per scaling group (the tensor's amax under a given scale, for
    the next delayed update) and the cast's [saturated, flushed] counts (None unless stats were asked)."""

    tensor: QuantizedTensor
    amax: torch.Tensor
    counts: torch.Tensor | None


@dataclass(frozen=True)
class Quantizer:
    """Quantizes one role's tensor for one GEMM: `format` elements, scales grouped by `layout`, each scale
    FORMAT_MAX / amax of its group (rounded down to a power of two with `power_of_2_scale`), or a given per-tensor
    scale (delayed scaling). A new format subclasses it and overrides `cast` (its twin) where the kernels' quantize
    does not cover it; everything else here works on any block layout."""

    format: ElementFormat
    layout: ScaleLayout
    power_of_2_scale: bool = False

    @property
    def granularity(self) -> Granularity | ScaleLayout:
        """The kernels' name of the layout (Granularity) where it has one."""
        return layout_granularity(self.layout)

    @property
    def has_fused_prologue(self) -> bool:
        """Whether the fused RMSNorm/SwiGLU + quantize kernels (prologue.py) cast like this quantizer: the kernels'
        own cast on one of their layouts. A quantizer with its own cast quantizes the prologue's output instead."""
        return type(self).cast is Quantizer.cast and isinstance(self.granularity, Granularity)

    @property
    def needs_global_amax(self) -> bool:
        """Whether current scaling of a tensor split over ranks needs the amax agreed over them first (one scale
        for the whole tensor); row and block groups are local to the rows that hold them."""
        return self.layout == PER_TENSOR

    def scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        return scale_from_amax(amax, self.format.max, self.power_of_2_scale)

    def fixed_scale(self, device: torch.device) -> torch.Tensor | None:
        """The scale this quantizer always casts with (a static recipe), or None: the tensor's amax decides."""
        return None

    stochastic = False  # rounds stochastically (a subclass may): its quantize wants a `key`

    @property
    def transposes_shard_locally(self) -> bool:
        """Whether a sequence shard's transposed copy is quantized from this rank's high-precision rows, its groups
        lying in the shard (microscaling's 1x16/1x32 token groups), instead of re-quantized after the gather."""
        return False

    def cast(self, x2d: torch.Tensor, *, scale: torch.Tensor | None, transpose: bool, stats: bool,
             key: int | None = None) -> Quantized:
        """The cast itself (the kernels' quantize: Triton on CUDA, the reference twin on CPU); `key` is for
        quantizers that round stochastically."""
        q = quantize(x2d, self.format.dtype, self.granularity, power_of_2_scale=self.power_of_2_scale, scale=scale,
                     transpose=transpose, stats=stats)
        return Quantized(QuantizedTensor.from_quantized(q, self.layout), q.amax, q.counts)

    def quantize(self, x2d: torch.Tensor, *, scale: torch.Tensor | None = None, transpose: bool = False,
                 stats: bool = False, key: int | None = None) -> Quantized:
        """x2d (rows, K) quantized with current scaling (or the given per-tensor `scale`); `transpose` adds the
        copy of x2d.T with its own groups; `key` seeds stochastic rounding (where the quantizer does it)."""
        # Only a stochastic quantizer is handed a key: a plugin's cast written before keys existed keeps working.
        extra = {"key": key} if key is not None else {}
        return self.cast(x2d, scale=scale, transpose=transpose, stats=stats, **extra)

    def quantize_with_prologue(self, prologue: InputPrologue, x2d: torch.Tensor, params: tuple[torch.Tensor, ...], *,
                               scale: torch.Tensor | None, transpose: bool,
                               stats: bool) -> tuple[Quantized, tuple[torch.Tensor, ...]]:
        """prologue(x2d) quantized by the prologue's fused kernel, with what its backward needs."""
        q, extras = prologue.quantize(x2d, *params, self.format.dtype, self.granularity,
                                      power_of_2_scale=self.power_of_2_scale, scale=scale, transpose=transpose,
                                      stats=stats)
        return Quantized(QuantizedTensor.from_quantized(q, self.layout), q.amax, q.counts), extras

    # ---- a tensor sharded along the sequence (rows) over a tensor-parallel group ----
    def fuses_sequence_shard(self, rows: int, scale: torch.Tensor | None, transpose: bool) -> bool:
        """Whether a fused cast of this rank's sequence shard is bit for bit what the unfused SP path gathers (and,
        with `transpose`, keeps as its x^T shard), i.e. every scale group it uses lies in this shard: one scale only
        when given (a warm delayed state: the same on every rank; its x^T shard is the local bytes transposed);
        1x128 when x^T is not needed or this rank's rows start and end on multiples of 128 (the copy's 128-token
        groups are then this rank's own); rowwise only without x^T (a channel's scale spans every rank's tokens).
        Current per-tensor scaling and cold delayed states need the amax over all ranks before the cast: they keep
        the unfused path, as does rowwise/unaligned 1x128 with x^T."""
        if self.layout == PER_TENSOR:
            return scale is not None
        if self.layout == BLOCK_1X128:
            return not transpose or rows % BLOCK == 0  # equal shards: rank * rows is then a multiple of 128 too
        return not transpose

    def agreed_scale(self, x2d: torch.Tensor, scale: torch.Tensor | None,
                     comm: SequenceParallelComm) -> torch.Tensor | None:
        """The per-tensor scale every rank of a gather uses: `scale` (delayed: identical on every rank), or current
        scaling from the MAX of the shards' amaxes. None for row/block groups (local to their rows)."""
        if scale is None and self.needs_global_amax:
            amax = x2d.detach().abs().amax().float()
            comm.sync_amax(amax)
            scale = self.scale_from_amax(amax)
        return scale

    def transposed_sequence_shard(self, x2d: torch.Tensor, local: QuantizedTensor, comm: SequenceParallelComm,
                                  key: int | None = None) -> TransposedShard:
        """This rank's columns of the full sequence's transposed copy, with the scales of the WHOLE copy (and the
        per-tensor decode scale of a two-level format, None here). `key` is for quantizers that round stochastically.

        The transposed copy's groups run along tokens, across every rank's rows (a row per channel for rowwise, 1x128
        token tiles for blockwise), so each rank takes the amax of its part of every group, the group MAX-reduces them
        (a (in, groups) fp32 tensor, <= 1/32 of the FP8 bytes) and every rank quantizes its own high-precision shard
        with the full group's scale: one rounding, bit-identical to what a TP=1 run quantizes, and only the bytes need
        to be re-gathered for wgrad."""
        if self.layout == PER_TENSOR:  # one scale, agreed before the gather: the same bytes, moved
            return TransposedShard(local.data.t().contiguous(), local.scale_inv)
        if self.layout not in (PER_ROW, BLOCK_1X128):
            raise NotImplementedError(f"a sequence-sharded transposed copy in layout {self.layout.name}")
        rows, cols = x2d.shape
        total = rows * comm.size
        if self.layout == PER_ROW:
            group = torch.zeros(rows, dtype=torch.long, device=x2d.device)
        else:
            group = torch.arange(comm.rank * rows, (comm.rank + 1) * rows, device=x2d.device) // BLOCK
        xt = x2d.detach().t().float()
        # Reductions, not a scatter of every element onto its group (a rowwise channel's tokens all on one address);
        # NaN propagates, as in the quantizer.
        if self.layout == PER_ROW:
            amax = xt.abs().amax(1, keepdim=True)
        else:  # this shard's tokens padded out to whole 1x128 tiles of the full sequence (zeros change no MAX)
            amax = xt.new_zeros(cols, math.ceil(total / BLOCK))
            first, lead = divmod(comm.rank * rows, BLOCK)
            tiles = F.pad(xt.abs(), (lead, -(lead + rows) % BLOCK)).view(cols, -1, BLOCK).amax(-1)
            amax[:, first:first + tiles.shape[1]] = tiles
        comm.sync_amax(amax)
        scale = self.scale_from_amax(amax)
        # x * scale is rounded exactly as the quantizer rounds it; a given scale of one only casts (saturating).
        one = torch.ones((), device=xt.device)
        data_t = quantize(xt * scale[:, group], self.format.dtype, Granularity.TENSORWISE, scale=one).data
        return TransposedShard(data_t, torch.ones_like(scale) / scale)  # an IEEE reciprocal, as the quantizer's

    def transposed_fused_shard(self, local: QuantizedTensor, comm: SequenceParallelComm) -> TransposedShard:
        """transposed_sequence_shard's result from a fused cast of the shard (see fuses_sequence_shard): the bytes are
        the kernel's own transposed copy; 1x128 scales are placed among the whole copy's and the group MAX-reduces
        them (each group is one rank's, the others hold 0: the same collective as the unfused path's amax)."""
        data_t, scale_t = local.col_major()
        if self.layout == PER_TENSOR:
            return TransposedShard(data_t, scale_t)
        groups = scale_t.shape[1]
        full = scale_t.new_zeros(scale_t.shape[0], groups * comm.size)
        # A NaN scale (an inf/NaN amax) travels as +inf: a MAX with another rank's 0 may drop a NaN (gloo's std::max,
        # NCCL), never an inf; no finite amax gives an infinite 1/scale, so every inf is a NaN scale again after.
        full[:, comm.rank * groups:(comm.rank + 1) * groups] = scale_t.nan_to_num(nan=float("inf"))
        comm.sync_amax(full)
        return TransposedShard(data_t, full.masked_fill_(full == float("inf"), float("nan")))

    def with_transposed_copy(self, full: QuantizedTensor) -> QuantizedTensor:
        """A gathered tensor with its transposed copy: one scale, the same bytes moved; row/1x128 groups of the
        transposed copy span every rank's rows, so the gathered values are re-quantized straight into it (a second
        rounding, instead of gathering twice)."""
        if self.layout == PER_TENSOR:
            return QuantizedTensor(full.shape, full.format, full.layout, full.data, full.scale_inv,
                                   full.data.t().contiguous(), full.scale_inv)
        t = self.cast(full.dequantize().t(), scale=None, transpose=False, stats=False).tensor
        return QuantizedTensor(full.shape, full.format, full.layout, full.data, full.scale_inv, t.data, t.scale_inv)
