"""Shared by the attention tests: a plain causal softmax attention in fp64 (the reference) and seeded inputs."""
from __future__ import annotations

import torch


def reference_attention(q, k, v, scale=None):
    """Full-sequence causal attention in fp64, one process; KV head of query head i is i // (H / G); logits times
    ``scale`` (default 1/sqrt(d))."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_inputs(b, heads, kv_heads, seq, d, seed):
    """q, k, v and an output gradient ``[b, heads or kv_heads, seq, d]`` in fp64."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, seq, d, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads, heads)]
