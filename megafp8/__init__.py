"""megafp8: Megatron-style 3D-parallel LLM pretraining with FP8 GEMMs, communication and optimizer state."""

__version__ = "0.1.0"
