"""RMSNorm computed in fp32 whatever the activation dtype (norms stay in high precision, see DESIGN.md)."""
from __future__ import annotations

import torch
from torch import nn

from megafp8.fp8.prologue import RMSNormPrologue, rms_norm


class RMSNorm(nn.Module):
    """``gain * x / sqrt(mean(x^2) + eps)``, Llama's normalization (no mean subtraction, no bias).

    Matches ``transformers`` LlamaRMSNorm: normalize in fp32, cast back, then scale. Under sequence
    parallelism each TP rank normalizes its own sequence chunk with a replicated weight, so the weight
    is tagged ``sequence_parallel`` and its grad is summed over TP after backward.

    ``zero_centered_gamma`` (--apply-layernorm-1p, Megatron's layernorm_zero_centered_gamma): the stored weight
    w starts at 0 and the gain is ``1 + w``, computed in the weight's dtype in every forward (Megatron's
    ``weight + 1``); the gradient reaching w is the gain's. Otherwise the gain is the weight, starting at 1
    (``initial_gain`` otherwise: --post-norm's 1/sqrt(L)).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 zero_centered_gamma: bool = False, initial_gain: float = 1.0) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        stored = initial_gain - 1 if zero_centered_gamma else initial_gain  # the gain is 1 + w when zero-centred
        self.weight = nn.Parameter(torch.full((hidden_size,), stored, dtype=params_dtype, device=device))
        self.weight.sequence_parallel = sequence_parallel

    def gain(self) -> torch.Tensor:
        """What x is scaled by: ``1 + weight`` when zero-centred, else the weight itself."""
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def forward(self, x: torch.Tensor, as_prologue: bool = False) -> torch.Tensor | RMSNormPrologue:
        """as_prologue=True returns this norm as the next linear's prologue (in FP8 fused into the quantization of
        its input, megafp8.fp8.prologue) instead of normalizing x. It is still a module call, so the module's
        forward hooks run: the overlapped parameter gather of --overlap-param-gather waits in one for this weight
        (so the gain is computed here, after it)."""
        if as_prologue:
            return RMSNormPrologue(self.gain(), self.eps)
        return rms_norm(x, self.gain(), self.eps)  # backward from the saved rstd (megafp8.fp8.prologue)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", zero_centered_gamma" if self.zero_centered_gamma else "")
