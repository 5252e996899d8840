"""The counter-based hash of counter_hash.py inside Triton kernels (the fused optimizer's fp16 encode, the FP4 casts'
stochastic rounding): int64 tensors holding 32-bit values, the same bits as the torch twin."""
import triton
import triton.language as tl


@triton.jit
def mix32_triton(x):
    """mix32 on a Triton int64 tensor."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def counter_uniform_triton(key, index):
    """counter_uniform_at on Triton int64 tensors: fp32 uniforms in [0, 1) with UNIFORM_BITS = 24 bits."""
    h = mix32_triton((index & 0xFFFFFFFF) ^ key)
    h = mix32_triton(h ^ (index >> 32) ^ mix32_triton(key ^ 0x9E3779B9))
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
