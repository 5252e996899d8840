"""FP8 recipes: which scaling, which formats, how delayed scales update. One frozen dataclass, per run or per layer."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from megafp8_kernels import Granularity

SCALINGS = ("delayed", "tensorwise", "rowwise", "blockwise")
FORMATS = ("e4m3", "hybrid")
AMAX_ALGOS = ("max", "most_recent")
ROLES = ("input", "weight", "grad_output")  # the three FP8 tensors of a linear layer


@dataclass(frozen=True)
class Fp8Recipe:
    """How a linear layer's GEMMs run in FP8.

    scaling:            delayed    per-tensor scale from an amax history (TransformerEngine's DelayedScaling)
                        tensorwise per-tensor current scaling (amax of this tensor now)
                        rowwise    one scale per row of each K-major operand
                        blockwise  DeepSeek-V3: 1x128 tiles for inputs and gradients, 128x128 for weights
    fp8_format:         e4m3 everywhere, or hybrid = E4M3 forward, E5M2 for gradients
    amax_history_len, amax_compute_algo, margin: delayed scaling only;
                        scale = FP8_MAX / amax / 2**margin with amax = max(history) or the most recent entry
    power_of_2_scale:   round every scale down to a power of two (exact to invert, no mantissa rounding)
    fprop_fast_accum:   fprop (x W^T) lets the tensor core accumulate over all of K without promoting to fp32
                        every K step (TransformerEngine's recipes do so in fprop; dgrad/wgrad always promote).
                        Only tensorwise/rowwise GEMMs offer it (delayed, tensorwise, rowwise); blockwise promotes
                        every 128 of K by construction. CUDA only: the CPU reference GEMM is exact either way.
    """

    scaling: Literal["delayed", "tensorwise", "rowwise", "blockwise"] = "delayed"
    fp8_format: Literal["e4m3", "hybrid"] = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: int = 0
    power_of_2_scale: bool = False
    fprop_fast_accum: bool = True

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"--fp8-recipe {self.scaling!r} is not one of {', '.join(SCALINGS)}")
        if self.fp8_format not in FORMATS:
            raise ValueError(f"--fp8-format {self.fp8_format!r} is not one of {', '.join(FORMATS)}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo {self.amax_compute_algo!r} is not one of {', '.join(AMAX_ALGOS)}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")

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
        # DeepSeek-V3 uses E4M3 for gradients too: 1x128 groups leave E5M2's extra range unneeded.
        return cls(scaling="blockwise", **{"fp8_format": "e4m3", **kw})

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
        )

    def replace(self, **overrides) -> Fp8Recipe:
        """A per-layer override, e.g. `recipe.replace(scaling="blockwise")`."""
        return dataclasses.replace(self, **overrides)

    # ---- what the linear layer asks ----
    @property
    def is_delayed(self) -> bool:
        return self.scaling == "delayed"

    def dtype(self, role: str) -> torch.dtype:
        if role == "grad_output" and self.fp8_format == "hybrid":
            return torch.float8_e5m2  # gradients need range more than precision
        return torch.float8_e4m3fn

    def fast_accum(self, gemm: str) -> bool:
        """Whether GEMM `gemm` (fprop, dgrad, wgrad) accumulates fast (see `fprop_fast_accum`)."""
        return gemm == "fprop" and self.fprop_fast_accum and self.scaling != "blockwise"

    def granularity(self, role: str) -> Granularity:
        if self.scaling in ("delayed", "tensorwise"):
            return Granularity.TENSORWISE
        if self.scaling == "rowwise":
            return Granularity.ROWWISE
        return Granularity.BLOCK_128X128 if role == "weight" else Granularity.BLOCK_1X128
