"""A counter-based hash for stochastic rounding: uniforms that are a pure function of (key, flat index), the same
on every backend and under any sharding (the optimizer's fp16 encode uses it today; gradient quantizers can too).

Keys come from (seed, step, name): a resumed run draws the same bits. The Triton kernels re-state ``mix32`` on their
own integer tensors (counter_hash_triton.py, used by megafp8.optim.fused_adamw_coded and the FP4 casts);
this file is their twin (it imports no Triton: the reference path of every cast imports it).
"""
from __future__ import annotations

import zlib

import torch

_MASK32 = 0xFFFFFFFF
UNIFORM_BITS = 24  # an fp32 holds a 24-bit integer exactly, so u = k / 2^24 is exact


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash on int64 tensors holding 32-bit values (products wrap in
    int64; only their low 32 bits are kept, which two's-complement wrapping leaves exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def mix32_int(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rounding_key(seed: int, step: int, name: str) -> int:
    """A 32-bit key for one parameter's encode at one step (``name`` salts parameters apart)."""
    return mix32_int(mix32_int(mix32_int(seed) ^ step) ^ zlib.crc32(name.encode()))


def rounding_keys(seed: int, step: torch.Tensor, name_salts: torch.Tensor) -> torch.Tensor:
    """``rounding_key`` on the device: ``step`` an int64 tensor, ``name_salts`` the names' crc32 (int64)."""
    return mix32(mix32(mix32_int(seed) ^ step) ^ name_salts)


def counter_uniform(key: int, start: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 uniforms in [0, 1) for elements ``[start, start + n)``: ``hash(key, index)``, one per index."""
    return counter_uniform_at(torch.tensor(key, dtype=torch.int64, device=device),
                              torch.arange(start, start + n, dtype=torch.int64, device=device))


def counter_uniform_at(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``counter_uniform`` at arbitrary flat indices (int64), with int64 keys broadcast against them: the
    optimizer draws a whole shard's uniforms at once, each element keyed by its parameter's key."""
    h = mix32((index & _MASK32) ^ key)
    h = mix32(h ^ (index >> 32) ^ mix32(key ^ 0x9E3779B9))
    return (h >> (32 - UNIFORM_BITS)).to(torch.float32) * 2.0 ** -UNIFORM_BITS
