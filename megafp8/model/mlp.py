"""SwiGLU feed-forward block with a fused gate/up column-parallel projection.

``linear_fc1.weight`` (TP=1) is ``[gate; up]``, ``[2 * ffn, hidden]``. It is sharded with
``partition_stride=2``: rank r holds ``[gate_r; up_r]`` (``[2 * ffn/TP, hidden]``), so the local
output splits into gate and up halves with no communication.

Smooth-SwiGLU (``--activation smooth_swiglu``) rescales the FP8 input of ``linear_fc2`` per channel
and folds the inverse scale into the GEMM output; in high precision it equals SwiGLU exactly, so here
both compute ``silu(gate) * up`` and ``self.activation`` tells the FP8 path which one to run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.model.config import ModelConfig
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_method_normal


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class MLP(nn.Module):
    """``[s/TP or s, b, hidden]`` -> fc1 -> ``[s, b, 2 * ffn/TP]`` -> SwiGLU -> fc2 -> same shape as the input."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState) -> None:
        super().__init__()
        self.activation = config.activation
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, 2 * config.ffn_hidden_size, parallel_state,
                                               init_method=init_method_normal(config.init_method_std),
                                               partition_stride=2, params_dtype=config.params_dtype)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, parallel_state,
                                            init_method=init_method_normal(config.output_init_std),
                                            params_dtype=config.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(self._activation(gate, up))

    def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU; the hook the FP8 Smooth-SwiGLU path overrides (together with fc2's input quantization)."""
        return swiglu(gate, up)
