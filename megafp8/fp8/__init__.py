"""Low-precision numerics (FP8, MX, FP4): recipes (a registry of scaling rules) handing out a Quantizer per
(role, GEMM), quantized tensors, the linear op, scaling state, telemetry and the guard."""
from .autocast import fp8_autocast, fp8_enabled
from .linear import Fp8GemmModule, Fp8Linear, WeightQuantization, invalidate_fp8_weight_caches
from .linear_function import SequenceParallelComm, add_bias, fp8_linear
from .precision import apply_precision_map, layer_recipes
from .precision_plan import (AUTOCAST, CONFIG, GUARD, SCHEDULE, PrecisionChange, PrecisionPlan, plan_of, precision_plan,
                             precision_plans)
from .quantizer import Quantized, Quantizer
from .recipe import (SCALING_RULES, Fp8Recipe, ScalingRule, register_scaling, registered_scaling, scaling_names,
                     unregister_scaling)
from .scaling_state import Fp8ScalingManager, ScalingState
from .smooth_swiglu import smooth_swiglu_channel_scales, swiglu
from .telemetry import SaturationGuard, collect_fp8_telemetry, enable_fp8_telemetry
from .tensor import Float8Tensor, QuantizedTensor

__all__ = [
    "Float8Tensor", "Fp8GemmModule", "WeightQuantization", "add_bias", "Fp8Linear", "SequenceParallelComm", "Fp8Recipe",
    "Fp8ScalingManager", "Quantized", "QuantizedTensor", "Quantizer", "SCALING_RULES", "SaturationGuard", "ScalingRule",
    "ScalingState", "register_scaling", "registered_scaling", "scaling_names", "unregister_scaling",
    "apply_precision_map", "collect_fp8_telemetry", "enable_fp8_telemetry", "fp8_autocast", "fp8_enabled",
    "fp8_linear", "invalidate_fp8_weight_caches", "layer_recipes", "smooth_swiglu_channel_scales", "swiglu",
    "AUTOCAST", "CONFIG", "GUARD", "SCHEDULE", "PrecisionChange", "PrecisionPlan", "plan_of", "precision_plan",
    "precision_plans",
]
