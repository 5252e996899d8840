"""Data pipeline: tokenizers, Megatron-compatible indexed datasets (.bin/.idx), GPT sampling, blending and splits."""
