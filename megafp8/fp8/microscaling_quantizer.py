"""MicroscalingQuantizer: the Quantizer of the MXFP8, MXFP4 and NVFP4 recipes (kernels/microscaling.py's cast), with
what a tensor sharded along the sequence needs: NVFP4's per-tensor scale agreed over the ranks (MAX of their amaxes,
TransformerEngine's rule) and a transposed copy whose 1x16 / 1x32 token groups lie in each rank's shard."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megafp8_kernels.counter_hash import mix32_int
from megafp8_kernels.microscaling import nvfp4_encode_scale, quantize_microscaled
from megafp8_kernels.microscaling_reference import HADAMARD_SIZE, random_hadamard_transform

from .quantizer import Quantized, Quantizer, TransposedShard

if TYPE_CHECKING:
    from megafp8_kernels import QuantizedTensor

    from .linear_function import SequenceParallelComm


@dataclass(frozen=True)
class MicroscalingQuantizer(Quantizer):
    """An MX (E8M0 per 1x32) or NVFP4 (E4M3 per 1x16 / 16x16 under an fp32 per-tensor scale) quantizer.

    hadamard_transposed: the transposed copy (the wgrad operand) goes through the 16-point random Hadamard transform
    stochastic:          round stochastically (the gradients: NVFP4's dgrad and wgrad operands)
    scale_rounding:      MX scales: "ceil" (RCEIL, the default) or "floor" (OCP, for comparison)
    """

    hadamard_transposed: bool = False
    stochastic: bool = False
    scale_rounding: str = "ceil"

    @property
    def two_level(self) -> bool:
        return self.layout.two_level

    @property
    def needs_global_amax(self) -> bool:
        return self.two_level  # NVFP4's per-tensor scale spans every rank's shard; MX blocks are local

    @property
    def transposes_shard_locally(self) -> bool:
        return self.layout.block[0] == 1  # 1x16 / 1x32: the transposed copy's token groups lie in a shard

    @property
    def token_group(self) -> int:
        """Tokens a rank's shard must hold a multiple of, so the transposed copy's groups (and Hadamard blocks)
        never straddle two ranks."""
        return max(self.layout.block[1], HADAMARD_SIZE if self.hadamard_transposed else 1)

    def scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """NVFP4: the per-tensor encode scale S_enc of an (agreed) amax. MX has no per-tensor scale."""
        if not self.two_level:
            raise ValueError(f"{self.layout.name} has no per-tensor scale")
        return nvfp4_encode_scale(amax)

    # An eager island under --compile (megafp8.model.compile.mark_eager_islands): inductor (torch 2.13) fails on the
    # cast's 1x32 / 16x16 block views (an AssertionError in its tiling); the GEMM and the rest still compile.
    def cast(self, x2d: torch.Tensor, *, scale: torch.Tensor | None, transpose: bool, stats: bool,
             key: int | None = None) -> Quantized:
        """`scale` is NVFP4's agreed S_enc (None: this tensor's own); `key` is used only if `stochastic`."""
        tensor, amax, counts = quantize_microscaled(
            x2d, self.format, self.layout, transpose=transpose, hadamard_transposed=self.hadamard_transposed,
            key=key if self.stochastic else None, scale_rounding=self.scale_rounding,
            encode_scale=scale if self.two_level else None, stats=stats)
        return Quantized(tensor, amax, counts)

    # ---- a tensor sharded along the sequence (rows) over a tensor-parallel group ----
    def fuses_sequence_shard(self, rows: int, scale: torch.Tensor | None, transpose: bool) -> bool:
        return False  # no fused RMSNorm/SwiGLU prologue casts to these formats

    def transposed_sequence_shard(self, x2d: torch.Tensor, local: QuantizedTensor, comm: SequenceParallelComm,
                                  key: int | None = None) -> TransposedShard:
        """This rank's columns of the full sequence's transposed copy, quantized from its own high-precision rows:
        (payload, block scales of the WHOLE copy (gathered here: 1/16 of the payload bytes or less), per-tensor
        decode scale or None). NVFP4: the transformed copy's amax is MAX-reduced first, so every rank casts with the
        TP=1 run's S_enc; the bytes are those of a TP=1 run (up to stochastic draws, which are keyed per rank)."""
        rows = x2d.shape[0]
        if not self.transposes_shard_locally:
            raise NotImplementedError(f"a sequence-sharded transposed copy in layout {self.layout.name}")
        if rows % self.token_group:
            raise ValueError(
                f"the {self.layout.name} recipe under --sequence-parallel needs each rank's tokens (micro-batch x "
                f"seq-length / tensor-parallel size = {rows}) to be a multiple of {self.token_group}: the transposed "
                "copy's token groups must not straddle two ranks")
        xt = x2d.detach().float().t().contiguous()
        if self.hadamard_transposed:
            xt = random_hadamard_transform(xt)
        encode_scale = None
        if self.two_level:  # the amax of the (transformed) copy over every rank's tokens
            amax = xt.abs().amax()
            comm.sync_amax(amax)
            encode_scale = nvfp4_encode_scale(amax)
        rank_key = mix32_int(key ^ (comm.rank + 1)) if key is not None and self.stochastic else None
        # The copy of x.T is the row-major copy of this shard's transpose (rows = channels, K = this rank's tokens).
        q = quantize_microscaled(xt, self.format, self.layout, key=rank_key, scale_rounding=self.scale_rounding,
                                 encode_scale=encode_scale)[0]
        scales = comm.gather_cols_async(q.scale_inv).wait()
        return TransposedShard(q.data, scales, q.global_scale_inv)

    def with_transposed_copy(self, full: QuantizedTensor) -> QuantizedTensor:
        raise NotImplementedError(f"{self.layout.name}: the transposed copy of a gathered tensor is quantized from each "
                                  "rank's high-precision shard (transposed_sequence_shard), not re-quantized")

