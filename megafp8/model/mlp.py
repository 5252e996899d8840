"""SwiGLU feed-forward block with a fused gate/up column-parallel projection (or, with ``--activation xielu``,
FOG's non-gated fc1 -> xIELU -> fc2: megafp8.model.xielu).

``linear_fc1.weight`` (TP=1) is ``[gate; up]``, ``[2 * ffn, hidden]``. It is sharded with
``partition_stride=2``: rank r holds ``[gate_r; up_r]`` (``[2 * ffn/TP, hidden]``), so the local
output splits into gate and up halves with no communication.

Smooth-SwiGLU (``--activation smooth_swiglu``, megafp8.fp8.smooth_swiglu) scales each channel of
``linear_fc2``'s input by a power of two before its FP8 quantization and folds the inverse into fc2's
weight columns: the same function (bit-identical in high precision), without one outlier channel
setting the FP8 scale of all the others. The channels are local to a TP rank: no communication.
"""
from __future__ import annotations

import torch
from torch import nn

from megafp8.fp8 import smooth_swiglu_channel_scales, swiglu
from megafp8.fp8.prologue import RMSNormPrologue, SwiGLUPrologue

from megafp8.model.config import ModelConfig
from megafp8.model.xielu import XIELU
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.tensor_parallel import ColumnParallelLinear, LinearLayout, RowParallelLinear, init_method_normal


class MLP(nn.Module):
    """``[s/TP or s, b, hidden]`` -> fc1 -> ``[s, b, 2 * ffn/TP]`` -> SwiGLU -> fc2 -> same shape as the input."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState | LinearLayout) -> None:
        super().__init__()
        self.activation = config.activation
        gated = self.activation != "xielu"
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, (2 if gated else 1) * config.ffn_hidden_size,
                                               parallel_state, init_method=init_method_normal(config.init_method_std),
                                               partition_stride=2 if gated else 1, params_dtype=config.params_dtype,
                                               perform_initialization=False)
        self.xielu = None if gated else XIELU(params_dtype=config.params_dtype)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, parallel_state,
                                            init_method=init_method_normal(config.output_init_std),
                                            params_dtype=config.params_dtype, perform_initialization=False)
        # Under Smooth-SwiGLU FC2 quantizes W / s per input: no per-step FP8 weight to prepare (megafp8.model.compile).
        self.linear_fc2.smooths_input = self.activation == "smooth_swiglu"

    def forward(self, x: torch.Tensor, input_norm: RMSNormPrologue | None = None,
                fuse_activation: bool = False) -> torch.Tensor:
        """`input_norm`: x is the input of this norm (RMSNorm(x, as_prologue=True)), fused into FC1's FP8 input cast.
        `fuse_activation`: the SwiGLU runs inside FC2's FP8 input cast (megafp8.fp8.prologue), never written in
        high precision."""
        gate_up = self.linear_fc1(x, prologue=input_norm)
        if self.xielu is not None:  # no fused prologue: the activation runs on its own before FC2's cast
            return self.linear_fc2(self.xielu(gate_up))
        smooth = self.activation == "smooth_swiglu"
        if fuse_activation:
            # Smooth-SwiGLU's scales need the activation's per-channel amax before the cast: one extra pass.
            scale = smooth_swiglu_channel_scales(swiglu(*gate_up.detach().chunk(2, dim=-1))) if smooth else None
            return self.linear_fc2(gate_up, input_channel_scale=scale, prologue=SwiGLUPrologue())
        h = swiglu(*gate_up.chunk(2, dim=-1))
        return self.linear_fc2(h, input_channel_scale=smooth_swiglu_channel_scales(h) if smooth else None)
