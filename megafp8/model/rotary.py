"""Rotary position embeddings (RoPE) in the "rotate half" convention used by HF Llama checkpoints, with
Llama-3.1's frequency scaling (``rope_type: "llama3"``)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1/3.2's RoPE frequency scaling (HF ``rope_scaling`` with ``rope_type: "llama3"``).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their frequency,
    those longer than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and
    the band between is interpolated smoothly: the short-range (high-frequency) dims keep the resolution
    the model was pretrained with while the long ones stretch to a ``factor`` times longer context.
    Defaults are Llama-3.1-8B's (Megatron-LM's hard-coded values); Llama-3.2-1B/3B use factor 32.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

    def errors(self, name: Callable[[str], str]) -> list[str]:
        """What makes these values unusable, each message naming its field as ``name(field)`` spells it
        (a flag for the training entry, a config.json key for the converter)."""
        problems = [f"{name(field)} must be positive, got {getattr(self, field)}"
                    for field in self.FIELDS if not getattr(self, field) > 0]
        if not problems and self.high_freq_factor <= self.low_freq_factor:
            # The smooth band's interpolation divides by their difference.
            problems.append(f"{name('high_freq_factor')} ({self.high_freq_factor}) must exceed "
                            f"{name('low_freq_factor')} ({self.low_freq_factor})")
        return problems

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies, in the same fp32 operations as transformers' and Megatron-Core's
        ``llama3`` code (so a converted checkpoint sees bit-identical angles)."""
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> torch.Tensor:
    """``theta^(-2i/d)`` for ``i < d/2`` in fp32, scaled when ``scaling`` is given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return inv_freq if scaling is None else scaling.apply(inv_freq)


class RotaryEmbedding(nn.Module):
    """cos/sin tables in fp32 for positions ``[0, positions)``, grown on demand up to ``max_positions``.

    Frequencies ``theta^(-2i/d)`` pair dim ``i`` with dim ``i + d/2`` (not adjacent dims as in Meta's
    original code): HF Llama weights are permuted for exactly this pairing, so they load unchanged.

    The table starts at ``positions`` (default ``max_positions``; GPTModel passes --seq-length) because a
    Llama-3.1 config's 131072 positions would cost 128 MiB per model chunk that training never reads. A
    longer forward (evaluation, a parity check at another length) rebuilds it for that length on the
    tables' device; each entry is one elementwise ``cos(p * inv_freq)``, so the values at a position do not
    depend on the table's length.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 scaling: Llama3RopeScaling | None = None, positions: int | None = None) -> None:
        super().__init__()
        self.max_positions = max_positions
        # Not persistent: all derived from the config, so checkpoints need not carry them. inv_freq stays so
        # that a grown table is computed from the very fp32 frequencies (made on the same device) as the first.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        cos, sin = self._tables(min(max_positions, positions or max_positions))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)  # (positions, head_dim)
        return angles.cos(), angles.sin()

    def forward(self, seq_len: int, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin shaped ``(seq_len, 1, 1, head_dim)`` to broadcast over ``[s, b, heads, d]``; with
        ``positions`` (the global positions of a context-parallel rank's tokens, all below ``seq_len``) the
        rows at those positions, ``(len(positions), 1, 1, head_dim)``."""
        if seq_len > self.max_positions:
            raise ValueError(f"sequence of {seq_len} tokens exceeds --max-position-embeddings ({self.max_positions})")
        if seq_len > self.cos.shape[0]:
            # Plain tensors even under inference_mode (an evaluation): a later training step saves them for backward.
            with torch.inference_mode(False):
                self.cos, self.sin = self._tables(seq_len)
        if positions is not None:
            positions = positions.to(self.cos.device)
            return self.cos[positions, None, None, :], self.sin[positions, None, None, :]
        return self.cos[:seq_len, None, None, :], self.sin[:seq_len, None, None, :]

    def _apply(self, fn, recurse=True):
        # model.bfloat16() / .half() must not round the angles (nor the frequencies a grown table starts from).
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, buf in self._buffers.items():
            if buf.dtype != torch.float32:
                self._buffers[name] = before[name].to(device=buf.device)
        return self


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` by the position angles (computed in fp32, returned in x's dtype)."""
    x_fp32 = x.float()
    return (x_fp32 * cos + _rotate_half(x_fp32) * sin).to(x.dtype)
