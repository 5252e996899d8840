"""Autograd-aware TP / sequence-parallel mappings in Megatron's vocabulary: each is a small autograd
Function that pairs a forward collective with its backward dual, and charges the bytes to its kind.

Activations are ``[seq, batch, hidden]``; "sequence" mappings work on dim 0 (contiguous chunks, so
no copies around the collective) and "tensor" gathers/splits work on the last dim.

===========================================  ==============================  ==============================
mapping                                      forward                         backward
===========================================  ==============================  ==============================
copy_to_tensor_model_parallel_region         identity                        all-reduce (tp_allreduce)
reduce_from_tensor_model_parallel_region     all-reduce (tp_allreduce)       identity
scatter_to_tensor_model_parallel_region      split last dim                  all-gather last dim (tp_allgather)
gather_from_tensor_model_parallel_region     all-gather last dim             split last dim
scatter_to_sequence_parallel_region          split dim 0                     all-gather dim 0 (tp_sp_allgather)
gather_from_sequence_parallel_region         all-gather dim 0                reduce-scatter dim 0 (tp_reduce_scatter)
                                             (tp_sp_allgather)               or split, see its docstring
reduce_scatter_to_sequence_parallel_region   reduce-scatter dim 0            all-gather dim 0 (tp_sp_allgather)
                                             (tp_reduce_scatter)
===========================================  ==============================  ==============================
"""
from __future__ import annotations

import torch

from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle


def _reduce_buffer(t: torch.Tensor, reuse: bool) -> torch.Tensor:
    """The tensor an in-place all-reduce may write: `t`'s own storage when the caller lends it, else a copy.

    Lending is what the layers do (no activation-sized copy, as in Megatron): the partial output of a
    GEMM or embedding, and the dgrad a GEMM just produced, are fresh tensors nobody else reads. A plain
    call copies, because the all-reduce overwrites its buffer: a caller's tensor, a gradient autograd
    hands to several branches (an add passes one tensor to both) or `y.backward(g)`'s `g` would change.
    `detach()` shares storage and version counter (bumped by _all_reduce below), so a saved-for-backward
    tensor that is overwritten still fails loudly in backward; it also avoids autograd's ban on modifying,
    in place, a view that a custom Function returned (the FP8 linear returns its output as a view).
    """
    if not t.is_contiguous():
        return t.contiguous()  # already a new tensor
    return t.detach() if reuse else t.clone()


def _all_reduce(buffer: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    C.all_reduce(buffer, tp, "tp_allreduce")
    # torch.distributed writes the buffer without bumping its version counter: do it, so autograd
    # notices when the lent buffer was also saved for some backward.
    torch.autograd.graph.increment_version(buffer)
    return buffer


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: GroupHandle, reuse_grad: bool) -> torch.Tensor:
        ctx.tp, ctx.reuse_grad = tp, reuse_grad
        return input_

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # Each TP rank consumed the same input with its own weight shard: input grads are partial sums.
        return _all_reduce(_reduce_buffer(grad_output, ctx.reuse_grad), ctx.tp), None, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: GroupHandle, reuse_input: bool) -> torch.Tensor:
        return _all_reduce(_reduce_buffer(input_, reuse_input), tp)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
        ctx.tp = tp
        return C.split_along_dim(input_, tp, dim=-1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return C.all_gather(grad_output.contiguous(), ctx.tp, "tp_allgather", dim=-1), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
        ctx.tp = tp
        return C.all_gather(input_.contiguous(), tp, "tp_allgather", dim=-1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return C.split_along_dim(grad_output, ctx.tp, dim=-1), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
        ctx.tp = tp
        return C.split_along_dim(input_, tp, dim=0)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return C.all_gather(grad_output.contiguous(), ctx.tp, "tp_sp_allgather", dim=0), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: GroupHandle, tensor_parallel_output_grad: bool) -> torch.Tensor:
        ctx.tp = tp
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return C.all_gather(input_.contiguous(), tp, "tp_sp_allgather", dim=0)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.tensor_parallel_output_grad:
            return C.reduce_scatter(grad_output, ctx.tp, "tp_reduce_scatter", dim=0), None, None
        return C.split_along_dim(grad_output, ctx.tp, dim=0), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
        ctx.tp = tp
        return C.reduce_scatter(input_, tp, "tp_reduce_scatter", dim=0)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return C.all_gather(grad_output.contiguous(), ctx.tp, "tp_sp_allgather", dim=0), None


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, tp: GroupHandle, *,
                                         reuse_grad: bool = False) -> torch.Tensor:
    """Enter a TP region with a replicated input (forward identity, backward all-reduce).

    reuse_grad=True: backward all-reduces the incoming gradient in its own storage instead of a copy.
    Only when the region's sole consumer is a GEMM (ColumnParallelLinear): its dgrad is a fresh tensor."""
    return input_ if tp.size == 1 else _CopyToTensorParallelRegion.apply(input_, tp, reuse_grad)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, tp: GroupHandle, *,
                                             reuse_input: bool = False) -> torch.Tensor:
    """Leave a TP region by summing partial results (forward all-reduce, backward identity).

    reuse_input=True: the sum is written into `input_`'s storage instead of a copy; only for a partial
    result nothing else reads (a row-parallel GEMM's or the vocab-parallel embedding's output)."""
    return input_ if tp.size == 1 else _ReduceFromTensorParallelRegion.apply(input_, tp, reuse_input)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    """Keep this rank's chunk of the last dim (backward all-gathers it)."""
    return input_ if tp.size == 1 else _ScatterToTensorParallelRegion.apply(input_, tp)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    """Concatenate the last dim over TP (backward keeps this rank's chunk)."""
    return input_ if tp.size == 1 else _GatherFromTensorParallelRegion.apply(input_, tp)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    """Keep this rank's chunk of the sequence (dim 0); backward all-gathers the grads."""
    return input_ if tp.size == 1 else _ScatterToSequenceParallelRegion.apply(input_, tp)


def gather_from_sequence_parallel_region(input_: torch.Tensor, tp: GroupHandle,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence (dim 0) before a column-parallel layer.

    ``tensor_parallel_output_grad=True`` (the column-parallel case): each TP rank's consumer produced
    only a partial grad for the full sequence, so backward reduce-scatters. Set it False when the
    consumer is replicated across TP (every rank already holds the full grad): backward just splits.
    """
    if tp.size == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, tp, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    """Sum the partial outputs of a row-parallel layer and keep this rank's sequence chunk."""
    return input_ if tp.size == 1 else _ReduceScatterToSequenceParallelRegion.apply(input_, tp)
