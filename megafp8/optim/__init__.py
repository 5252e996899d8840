"""Optimizers: AdamW with low-precision state codecs in a ZeRO distributed optimizer, and LR schedules."""
from .distributed_optimizer import DistributedOptimizer, StepResult
from .state_codec import STATE_DTYPES, make_state_codec

__all__ = ["DistributedOptimizer", "STATE_DTYPES", "StepResult", "make_state_codec"]
