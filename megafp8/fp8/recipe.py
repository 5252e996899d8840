"""FP8 recipes: which scaling, which formats, how delayed scales update. One frozen dataclass, per run or per layer;
it hands out a Quantizer per (role, GEMM) from the scaling rule registered under its name (`--fp8-recipe`'s choices)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

import torch

from megafp8_kernels import Granularity, ScaleLayout, element_format
from megafp8_kernels.formats import (BLOCK_1X128, BLOCK_128X128, E2M1, MX_1X32, NVFP4_1X16, NVFP4_16X16, PER_ROW,
                                     PER_TENSOR)

from .microscaling_quantizer import MicroscalingQuantizer
from .quantizer import Quantizer
from .static_quantizer import StaticQuantizer

FORMATS = ("e4m3", "hybrid")
AMAX_ALGOS = ("max", "most_recent")
ROLES = ("input", "weight", "grad_output")  # the three FP8 tensors of a linear layer
GEMMS = ("fprop", "dgrad", "wgrad")
# Which GEMMs read each role: the row-major copy feeds the first, the transposed copy the second.
ROLE_GEMMS = {"input": ("fprop", "wgrad"), "weight": ("fprop", "dgrad"), "grad_output": ("dgrad", "wgrad")}


@dataclass(frozen=True)
class ScalingRule:
    """One `--fp8-recipe` entry: what a recipe with this `scaling` quantizes each (role, GEMM) with.

    layout:          (role, gemm) -> the scale layout of that operand
    keeps_state:     scales come from per-role state (an amax history: delayed scaling) instead of the tensor now
    fast_accum:      its GEMMs may skip fp32 promotion in fprop (tensorwise/rowwise kernels; block scales promote
                     every K block by construction)
    default_format:  the --fp8-format it implies when the user names none for it (blockwise: e4m3)
    quantizer:       the Quantizer class (a new format brings its own cast)
    build:           builds the quantizer of (recipe, role, gemm) itself, where it depends on more than the layout
                     (microscaling: the element format, Hadamard, stochastic rounding, the recipe's ablation switches)
    element_bits:    bits per element of the recipe's GEMM operands (4: an FP4 recipe, --fp4-recipe)
    """

    layout: Callable[[str, str], ScaleLayout]
    keeps_state: bool = False
    fast_accum: bool = True
    default_format: str | None = None
    quantizer: type[Quantizer] = Quantizer
    build: Callable[[Fp8Recipe, str, str], Quantizer] | None = None
    element_bits: int = 8


def _mx_quantizer(recipe: Fp8Recipe, role: str, gemm: str) -> Quantizer:
    # MXFP8 (TE's MXFP8BlockScaling, Megatron's --fp8-recipe mxfp8): E4M3 (E5M2 gradients under hybrid) per 1x32.
    return MicroscalingQuantizer(element_format(recipe.dtype(role)), MX_1X32, scale_rounding=recipe.mx_scale_rounding)


def _fp4_quantizer(recipe: Fp8Recipe, role: str, gemm: str) -> Quantizer:
    # NVFP4 (TE's NVFP4BlockScaling) and MXFP4: E2M1; the weight in 16x16 tiles (NVFP4), the wgrad operands through
    # the Hadamard transform, the gradient rounded stochastically; each switch off for the papers' ablations.
    nvfp4 = recipe.scaling == "nvfp4"
    layout = (NVFP4_16X16 if role == "weight" and recipe.fp4_weight_2d else NVFP4_1X16) if nvfp4 else MX_1X32
    return MicroscalingQuantizer(E2M1, layout, hadamard_transposed=recipe.fp4_hadamard and role != "weight",
                                 stochastic=recipe.fp4_stochastic_rounding and role == "grad_output",
                                 scale_rounding=recipe.mx_scale_rounding)


def _static_quantizer(recipe: Fp8Recipe, role: str, gemm: str) -> Quantizer:
    # μnit Scaling: fixed scales, 1 for activations and weights (a unit-scaled model keeps them near 1), a power of two
    # for the gradients (--fp8-static-grad-scale: a mean loss over T tokens makes them ~1/T).
    scale = recipe.static_grad_scale if role == "grad_output" else 1.0
    return StaticQuantizer(element_format(recipe.dtype(role)), PER_TENSOR, static_scale=scale)


SCALING_RULES: dict[str, ScalingRule] = {
    "delayed": ScalingRule(lambda role, gemm: PER_TENSOR, keeps_state=True),
    "tensorwise": ScalingRule(lambda role, gemm: PER_TENSOR),
    "rowwise": ScalingRule(lambda role, gemm: PER_ROW),
    "static": ScalingRule(lambda role, gemm: PER_TENSOR, build=_static_quantizer),
    # DeepSeek-V3: 1x128 tiles for inputs and gradients, 128x128 for weights (the same tile for fprop and dgrad);
    # E4M3 for gradients too: 1x128 groups leave E5M2's extra range unneeded.
    "blockwise": ScalingRule(lambda role, gemm: BLOCK_128X128 if role == "weight" else BLOCK_1X128, fast_accum=False,
                             default_format="e4m3"),
    # Microscaling (Blackwell's block-scaled tensor cores; emulated elsewhere: a numerics study on Hopper and CPU).
    "mxfp8": ScalingRule(lambda role, gemm: MX_1X32, fast_accum=False, default_format="e4m3", build=_mx_quantizer),
    "nvfp4": ScalingRule(lambda role, gemm: NVFP4_16X16 if role == "weight" else NVFP4_1X16, fast_accum=False,
                         default_format="e4m3", build=_fp4_quantizer, element_bits=4),
    "mxfp4": ScalingRule(lambda role, gemm: MX_1X32, fast_accum=False, default_format="e4m3", build=_fp4_quantizer,
                         element_bits=4),
}
FP4_SCALINGS = tuple(name for name, rule in SCALING_RULES.items() if rule.element_bits == 4)  # --fp4-recipe
SCALINGS = tuple(SCALING_RULES)  # the built-in recipes
# The FP8 recipes with fp32 scales: the 3D bit fingerprint covers each (tools/fp8_bits_fingerprint.py); the microscaled
# ones are pinned by their own tests (their ZeRO runs gather high-precision weights, the fingerprint's FP8 ones).
FP8_SCALINGS = tuple(name for name, rule in SCALING_RULES.items() if rule.build is None)
MICROSCALED = (_mx_quantizer, _fp4_quantizer)


def is_power_of_two(value: float) -> bool:
    return math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5


def register_scaling(name: str, rule: ScalingRule) -> None:
    """Add a recipe: `Fp8Recipe(scaling=name)` and `--fp8-recipe name` (for parsers built after this call) use it."""
    if name in SCALING_RULES:
        raise ValueError(f"an FP8 recipe named {name!r} is already registered")
    SCALING_RULES[name] = rule


def unregister_scaling(name: str) -> None:
    """Remove a registered recipe (not a built-in); recipes already built with it stop resolving."""
    if name in SCALINGS:
        raise ValueError(f"the built-in FP8 recipe {name!r} cannot be removed")
    del SCALING_RULES[name]
    _quantizer.cache_clear()  # a later rule under the same name must not get this one's quantizers


@contextlib.contextmanager
def registered_scaling(name: str, rule: ScalingRule) -> Iterator[None]:
    """`register_scaling` for the duration of a `with` block (tests; a process-wide plugin calls register_scaling)."""
    register_scaling(name, rule)
    try:
        yield
    finally:
        unregister_scaling(name)


def scaling_names() -> tuple[str, ...]:
    """Every registered recipe name: `--fp8-recipe`'s choices."""
    return tuple(SCALING_RULES)


@dataclass(frozen=True)
class Fp8Recipe:
    """How a linear layer's GEMMs run in FP8.

    scaling:            delayed    per-tensor scale from an amax history (TransformerEngine's DelayedScaling)
                        tensorwise per-tensor current scaling (amax of this tensor now)
                        static     μnit Scaling's fixed scales: 1, and static_grad_scale for gradients (no amax,
                                   no state, no collective: for unit-scaled models)
                        rowwise    one scale per row of each K-major operand
                        blockwise  DeepSeek-V3: 1x128 tiles for inputs and gradients, 128x128 for weights
                        mxfp8      OCP MX: E4M3 (E5M2 gradients under hybrid) with one E8M0 scale per 1x32
                        nvfp4      E2M1 with one E4M3 scale per 1x16 (16x16 for weights) under an fp32 tensor scale
                        mxfp4      E2M1 with one E8M0 scale per 1x32 (the last two: --fp4-recipe)
    fp8_format:         e4m3 everywhere, or hybrid = E4M3 forward, E5M2 for gradients
    amax_history_len, amax_compute_algo, margin: delayed scaling only;
                        scale = FP8_MAX / amax / 2**margin with amax = max(history) or the most recent entry
    power_of_2_scale:   round every scale down to a power of two (exact to invert, no mantissa rounding)
    fprop_fast_accum:   fprop (x W^T) lets the tensor core accumulate over all of K without promoting to fp32
                        every K step (TransformerEngine's recipes do so in fprop; dgrad/wgrad always promote).
                        Only tensorwise/rowwise GEMMs offer it (delayed, tensorwise, rowwise); blockwise promotes
                        every 128 of K by construction. CUDA only: the CPU reference GEMM is exact either way.
    mx_scale_rounding:  mxfp8 / mxfp4 block scales rounded "ceil" (RCEIL: amax never saturates; TE, cuBLAS) or
                        "floor" (the OCP spec's rule, which saturates block maxima; for comparison)
    fp4_stochastic_rounding, fp4_hadamard, fp4_weight_2d: the FP4 recipes' parts (nvfp4, mxfp4), on by default as
                        NVIDIA's NVFP4 recipe: gradients rounded stochastically, the wgrad operands through the
                        16-point random Hadamard transform, 16x16 weight tiles (nvfp4); each can be switched off
    fprop_high_precision: the forward GEMM (x W^T) in high precision, dgrad and wgrad still in this recipe: the
                        NVFP4 paper's late switch of the forward pass only (set by a precision schedule)
    fp4_guard_fallback: the FP8 recipe the saturation guard moves a saturating FP4 layer to before BF16 (the ladder
                        FP4 -> FP8 -> BF16); "bf16" skips the FP8 step
    """

    scaling: str = "delayed"  # a SCALING_RULES name: delayed, tensorwise, rowwise, blockwise or a registered one
    fp8_format: Literal["e4m3", "hybrid"] = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: int = 0
    power_of_2_scale: bool = False
    fprop_fast_accum: bool = True
    mx_scale_rounding: Literal["ceil", "floor"] = "ceil"
    fp4_stochastic_rounding: bool = True
    fp4_hadamard: bool = True
    fp4_weight_2d: bool = True
    fprop_high_precision: bool = False
    fp4_guard_fallback: str = "mxfp8"
    static_grad_scale: float = 1.0

    def __post_init__(self):
        if self.scaling not in SCALING_RULES:
            raise ValueError(f"--fp8-recipe {self.scaling!r} is not one of {', '.join(SCALING_RULES)}")
        if self.fp8_format not in FORMATS:
            raise ValueError(f"--fp8-format {self.fp8_format!r} is not one of {', '.join(FORMATS)}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo {self.amax_compute_algo!r} is not one of {', '.join(AMAX_ALGOS)}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")
        if not is_power_of_two(self.static_grad_scale):
            raise ValueError(f"--fp8-static-grad-scale must be a power of two, got {self.static_grad_scale}")
        if self.mx_scale_rounding not in ("ceil", "floor"):
            raise ValueError(f"--mx-scale-rounding {self.mx_scale_rounding!r} is not 'ceil' or 'floor'")

    # ---- named factories (torchao style) ----
    @classmethod
    def delayed(cls, **kw) -> Fp8Recipe:
        return cls(scaling="delayed", **kw)

    @classmethod
    def tensorwise(cls, **kw) -> Fp8Recipe:
        return cls(scaling="tensorwise", **kw)

    @classmethod
    def rowwise(cls, **kw) -> Fp8Recipe:
        return cls(scaling="rowwise", **kw)

    @classmethod
    def blockwise(cls, **kw) -> Fp8Recipe:
        return cls.named("blockwise", **kw)

    @classmethod
    def named(cls, scaling: str, **kw) -> Fp8Recipe:
        """The recipe registered as `scaling`, with its rule's default format unless `fp8_format` is given."""
        default_format = SCALING_RULES[scaling].default_format if scaling in SCALING_RULES else None
        return cls(scaling=scaling, **{**({"fp8_format": default_format} if default_format else {}), **kw})

    @classmethod
    def from_args(cls, args) -> Fp8Recipe | None:
        """The run's recipe from Megatron-named flags; None when `--fp8-format` is not set (no FP8)."""
        if getattr(args, "fp8_format", None) is None:
            return None
        return cls(
            scaling=getattr(args, "fp8_recipe", "delayed"),
            fp8_format=args.fp8_format,
            amax_history_len=getattr(args, "fp8_amax_history_len", 1024),
            amax_compute_algo=getattr(args, "fp8_amax_compute_algo", "max"),
            margin=getattr(args, "fp8_margin", 0),
            power_of_2_scale=getattr(args, "fp8_power_of_2_scale", False),
            fprop_fast_accum=getattr(args, "fp8_fprop_fast_accum", True),
            mx_scale_rounding=getattr(args, "mx_scale_rounding", "ceil"),
            fp4_stochastic_rounding=not getattr(args, "fp4_no_stochastic_rounding", False),
            fp4_hadamard=not getattr(args, "fp4_no_hadamard", False),
            fp4_weight_2d=not getattr(args, "fp4_no_2d_weights", False),
            fp4_guard_fallback=getattr(args, "fp4_guard_fallback", "mxfp8"),
            static_grad_scale=getattr(args, "fp8_static_grad_scale", 1.0),
        )

    def guard_ladder(self) -> tuple[Fp8Recipe | None, ...]:
        """The recipes the saturation guard moves a layer of this recipe through, this one first, ending in None
        (high precision): an FP4 recipe steps through its FP8 fallback (--fp4-guard-fallback), FP8 goes to BF16."""
        if self.element_bits != 4 or self.fp4_guard_fallback == "bf16":
            return (self, None)
        fallback = Fp8Recipe.named(self.fp4_guard_fallback, fp8_format=self.fp8_format,
                                   mx_scale_rounding=self.mx_scale_rounding)
        return (self, fallback, None)

    def replace(self, **overrides) -> Fp8Recipe:
        """A per-layer override, e.g. `recipe.replace(scaling="blockwise")`."""
        return dataclasses.replace(self, **overrides)

    # ---- what the linear layer asks ----
    @property
    def rule(self) -> ScalingRule:
        return SCALING_RULES[self.scaling]

    def quantizer(self, role: str, gemm: str | None = None) -> Quantizer:
        """The quantizer of `role`'s operand in `gemm` (default: the GEMM its row-major copy feeds, ROLE_GEMMS)."""
        return _quantizer(self, role, gemm or ROLE_GEMMS[role][0])

    def keeps_state(self, role: str) -> bool:
        """Whether `role`'s scale comes from per-layer state (an amax history) rather than the tensor at hand."""
        return self.rule.keeps_state

    @property
    def element_bits(self) -> int:
        """Bits per GEMM operand element: 8 (FP8, MXFP8) or 4 (NVFP4, MXFP4)."""
        return self.rule.element_bits

    @property
    def is_microscaled(self) -> bool:
        """Block scales stored as E8M0 / E4M3 bytes (mxfp8, nvfp4, mxfp4)."""
        return self.rule.build in MICROSCALED

    @property
    def is_delayed(self) -> bool:
        """Any role keeps scaling state (the layers then own ScalingStates, and a manager reduces their amaxes)."""
        return any(self.keeps_state(role) for role in ROLES)

    def dtype(self, role: str) -> torch.dtype:
        if role == "grad_output" and self.fp8_format == "hybrid":
            return torch.float8_e5m2  # gradients need range more than precision
        return torch.float8_e4m3fn

    def fast_accum(self, gemm: str) -> bool:
        """Whether GEMM `gemm` (fprop, dgrad, wgrad) accumulates fast (see `fprop_fast_accum`)."""
        return gemm == "fprop" and self.fprop_fast_accum and self.rule.fast_accum

    def granularity(self, role: str) -> Granularity | ScaleLayout:
        """The layout of `role`'s row-major copy, by its Granularity name where it has one."""
        return self.quantizer(role).granularity


@functools.lru_cache(maxsize=None)
def _quantizer(recipe: Fp8Recipe, role: str, gemm: str) -> Quantizer:
    # Cached: the linear layer asks on every call, and recipes are frozen (a registered rule is never replaced).
    rule = recipe.rule
    if rule.build is not None:
        return rule.build(recipe, role, gemm)
    return rule.quantizer(element_format(recipe.dtype(role)), rule.layout(role, gemm), recipe.power_of_2_scale)
