"""The local experts' linears as grouped GEMMs (``--moe-grouped-gemm``, Megatron's flag), the loop of linears in
megafp8.model.moe being their twin.

High-precision experts run ``torch._grouped_mm`` over the rows of every expert at once. Rows arrive sorted by expert
(megafp8.model.moe.dispatch_order); ``offsets`` are the cumulative row counts, on the device: no expert's count is
read on the host. The weights are the experts' own parameters, stacked for the GEMM (one copy of the expert weights
per forward; their gradients flow back to each parameter through the stack). ``GroupedLinear``'s backward is written
out rather than left to autograd: dgrad is a grouped GEMM of the output gradient with the same weights, wgrad a
grouped GEMM whose groups run along the rows (``dYᵀ X`` per expert, the "2-D x 2-D" form), so it runs wherever the
forward does (autograd's own formula for ``_grouped_mm`` fails on CPU in fp32).

FP8 experts (``grouped_fp8_mlp``) run fc1 and fc2 through megafp8.fp8.grouped_linear_function: each expert's operands
quantized by its own linear, fprop, dgrad and wgrad one grouped FP8 GEMM each (megafp8_kernels.grouped_gemm), on the
loop's padded rows, so both paths see the same operands. The SwiGLU between them runs unfused (the loop fuses it into
fc2's FP8 input cast) and keeps only its input for backward, as the fused one does. MX and NVFP4 experts keep the loop.

Both paths read the experts' weights without calling their modules, so they run the modules' forward pre-hooks by
hand, those that read no input (``hooks_allow_grouping``: ZeRO's on-demand gather, the precision follower); a module
with any other hook (a forward hook, a test's pre-hook that edits the input) keeps the loop, which calls it.
"""
from __future__ import annotations

import torch
from torch import nn

from megafp8.fp8.grouped_linear_function import ExpertRows, grouped_fp8_linear
from megafp8.fp8.prologue import SwiGLUPrologue
from megafp8.fp8.recipe import Fp8Recipe


def grouped_gemm_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs these rows: fp32/bf16 on CPU, bf16 on a Hopper GPU (compute capability 9.x;
    on Blackwell an expert without rows gets a non-zero wgrad: pytorch#172439, so the loop runs there)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] == 9


class GroupedLinear(torch.autograd.Function):
    """``rows [M, in]`` sorted by expert, ``weights [E, out, in]``, ``offsets [E]`` (int32, cumulative counts) ->
    ``[M, out]``: expert e's rows times its weight transposed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weights, offsets)
        return torch._grouped_mm(rows, weights.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        rows, weights, offsets = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_rows = torch._grouped_mm(grad_output, weights, offs=offsets) if ctx.needs_input_grad[0] else None
        grad_weights = None
        if ctx.needs_input_grad[1]:  # per expert dYᵀ X over its rows; an expert without rows gets zeros
            grad_weights = torch._grouped_mm(grad_output.t(), rows, offs=offsets)
        return grad_rows, grad_weights, None


def grouped_linear(rows: torch.Tensor, weights: list[torch.Tensor], offsets: torch.Tensor) -> torch.Tensor:
    """The experts' linears (one weight ``[out, in]`` each) on their rows, as one grouped GEMM."""
    return GroupedLinear.apply(rows, torch.stack(weights), offsets)


def grouped_fp8_mlp(experts: list[nn.Module], runs: list[torch.Tensor], recipe: Fp8Recipe) -> list[torch.Tensor]:
    """Each expert's SwiGLU MLP on its (padded) rows, fc1 and fc2 as grouped FP8 GEMMs; one output per expert."""
    sizes = [run.shape[0] for run in runs]
    expert_rows = ExpertRows.of(sizes, runs[0].device)  # one copy to the device for both linears
    fc1, fc2 = [e.linear_fc1 for e in experts], [e.linear_fc2 for e in experts]
    for linear in fc1 + fc2:
        run_forward_pre_hooks(linear)  # its weight is read below without calling it
    gate_up = grouped_fp8_linear(torch.cat(runs), expert_rows, fc1, recipe)
    return grouped_fp8_linear(_SwiGLU.apply(gate_up), expert_rows, fc2, recipe).split(sizes)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of ``[gate | up]`` saving only its input, recomputed in backward (the fused SwiGLU cast's
    memory: autograd's own formulas would keep ``silu(gate)`` too); the same bits as the plain ops."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return SwiGLUPrologue().apply(gate_up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        return SwiGLUPrologue().backward(grad, (True,), gate_up)[0]


def hooks_allow_grouping(modules) -> bool:
    """Whether the grouped paths run these modules as calling them would: no forward hooks, and only forward pre-hooks
    that read no input (marked ``reads_no_input``), which ``run_forward_pre_hooks`` runs by hand."""
    return not any(module._forward_hooks or any(not getattr(hook, "reads_no_input", False)
                                                 for hook in module._forward_pre_hooks.values())
                   for module in modules)


def run_forward_pre_hooks(module: nn.Module) -> None:
    """What calling ``module`` runs before its forward, where every hook reads no input (``hooks_allow_grouping``):
    ZeRO's on-demand parameter gather (--overlap-param-gather), the precision follower's weight
    (megafp8.optim.precision_follower)."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, (), {})
        else:
            hook(module, ())
