"""Rotary position embeddings (RoPE) in the "rotate half" convention used by HF Llama checkpoints."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``[0, max_positions)``, computed once in fp32.

    Frequencies ``theta^(-2i/d)`` pair dim ``i`` with dim ``i + d/2`` (not adjacent dims as in Meta's
    original code): HF Llama weights are permuted for exactly this pairing, so they load unchanged.
    Llama-3.1 style frequency scaling (``rope_scaling``) is not implemented.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)  # (max_positions, head_dim)
        # Not persistent: derived from the config, so checkpoints need not carry it.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin shaped ``(seq_len, 1, 1, head_dim)`` to broadcast over ``[s, b, heads, d]``."""
        if seq_len > self.cos.shape[0]:
            raise ValueError(f"sequence of {seq_len} tokens exceeds --max-position-embeddings ({self.cos.shape[0]})")
        return self.cos[:seq_len, None, None, :], self.sin[:seq_len, None, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` by the position angles (computed in fp32, returned in x's dtype)."""
    x_fp32 = x.float()
    return (x_fp32 * cos + _rotate_half(x_fp32) * sin).to(x.dtype)
