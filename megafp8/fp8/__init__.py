"""Low-precision numerics (FP8 today; MX and FP4 next): recipes, scaled tensors, the FP8 linear, scaling state, telemetry and the guard."""
from .autocast import fp8_autocast, fp8_enabled
from .linear import Fp8GemmModule, Fp8Linear, WeightQuantization, invalidate_fp8_weight_caches
from .linear_function import SequenceParallelComm, add_bias, fp8_linear
from .precision import apply_precision_map, layer_recipes
from .recipe import Fp8Recipe
from .scaling_state import Fp8ScalingManager, ScalingState
from .smooth_swiglu import smooth_swiglu_channel_scales, swiglu
from .telemetry import SaturationGuard, collect_fp8_telemetry, enable_fp8_telemetry
from .tensor import Float8Tensor

__all__ = [
    "Float8Tensor", "Fp8GemmModule", "WeightQuantization", "add_bias", "Fp8Linear", "SequenceParallelComm", "Fp8Recipe", "Fp8ScalingManager", "SaturationGuard", "ScalingState",
    "apply_precision_map", "collect_fp8_telemetry", "enable_fp8_telemetry", "fp8_autocast", "fp8_enabled",
    "fp8_linear", "invalidate_fp8_weight_caches", "layer_recipes", "smooth_swiglu_channel_scales", "swiglu",
]
