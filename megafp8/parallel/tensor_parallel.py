"""Tensor-parallel layers (Megatron's column / row split) and the vocab-parallel embedding.

Activations are ``[seq, batch, hidden]``. With sequence parallelism (SP) the tensors between TP
regions (norm inputs, residuals) are ``[seq/TP, batch, hidden]``: a column-parallel layer gathers the
sequence before its GEMM and a row-parallel layer reduce-scatters after it.

Both linears are megafp8.fp8.Fp8GemmModule: their local GEMM (``_forward_impl``) runs in FP8 when a
recipe is active (the model's precision map, or fp8_autocast) and in high precision otherwise;
everything around it (entering/leaving the TP region, bias, gather_output) stays here:

- ``ColumnParallelLinear._forward_impl(input_, weight)``: input ``[s/TP, b, in]`` under SP (it owns
  the sequence all-gather: in FP8 the shard is quantized once and its uint8 bytes + scales are
  all-gathered, half the bytes of BF16) or ``[s, b, in]`` without SP; returns ``[s, b, out/TP]``.
  Under SP both precisions save only the local shard for wgrad and re-gather it in backward (Megatron's
  choice: the gathered input is TP times larger), FP8 as the FP8 bytes of its xᵀ shard.
- ``RowParallelLinear._forward_impl(input_parallel)``: ``[s, b, in/TP]`` to the reduced output:
  ``[s/TP, b, out]`` under SP (reduce-scatter in high precision; in FP8 the backward all-gather of the
  output gradient moves FP8 bytes) or ``[s, b, out]`` (all-reduce, high precision).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.fp8 import Fp8GemmModule, Fp8Recipe, add_bias
from megafp8.fp8.prologue import InputPrologue
from megafp8.parallel import collectives as C
from megafp8.parallel.fp8_sequence_parallel import TensorParallelSequenceComm
from megafp8.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.random import InitMethod, NormalInit, initialize_parameter_, set_init_method
from megafp8.parallel.sharding import set_tensor_model_parallel_attributes, vocab_range


@dataclass(frozen=True)
class LinearLayout:
    """What the linears below read of a layout, when it is not the model's ParallelState: the group splitting them
    and whether rows enter and leave split over it (as the sequence under SP). A MoE expert's linears under
    --expert-tensor-parallel-size get the etp group, its rows split over it (megafp8.model.moe)."""

    tp_group: C.GroupHandle
    sequence_parallel: bool


def init_method_normal(std: float) -> InitMethod:
    """N(0, std), applied to the parameter's full (TP=1) tensor before it is sliced (megafp8.parallel.random)."""
    return NormalInit(std)


def _init_weight(weight: nn.Parameter, init_method: InitMethod, tp: C.GroupHandle, perform_initialization: bool) -> None:
    # Full tensor from the default generator, then this rank's slice: every TP rank built under the same
    # seed holds a different shard of the same full tensor. GPTModel passes perform_initialization=False
    # and redraws each parameter by name (megafp8.parallel.random.initialize_parameters).
    set_init_method(weight, init_method)
    if perform_initialization:
        initialize_parameter_(weight, init_method, tp.rank, tp.size)


def _divide(numerator: int, denominator: int, what: str) -> int:
    # ParallelState.validate_model catches user-facing cases first; this guards direct layer use.
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by --tensor-model-parallel-size ({denominator})")
    return numerator // denominator


class _SequenceParallelLinear(torch.autograd.Function):
    """The high-precision GEMM of a column-parallel layer under SP, as Megatron-Core's
    LinearWithGradAccumulationAndAsyncCommunication with ``sequence_parallel``: forward all-gathers the
    ``[s/TP, b, in]`` shard but saves only the shard; backward re-gathers it while dgrad runs, then
    reduce-scatters dgrad while wgrad runs. The gathered input (TP times the shard) is not kept between
    forward and backward, at the price of a second all-gather of the shard per layer."""

    @staticmethod
    def forward(ctx, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: C.GroupHandle):
        ctx.tp = tp
        ctx.save_for_backward(input_, weight)
        return F.linear(C.all_gather(input_.contiguous(), tp, "tp_sp_allgather", dim=0), weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input_, weight = ctx.saved_tensors
        tp = ctx.tp
        needs_dgrad, needs_wgrad, needs_bgrad = ctx.needs_input_grad[:3]
        gather = None
        if needs_wgrad:
            total = torch.empty((tp.size * input_.shape[0], *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
            gather = C.all_gather_into_tensor_async(total, input_.contiguous(), tp, "tp_sp_allgather")
        dgrad = None
        if needs_dgrad:
            grad_input = grad_output.matmul(weight)
            shard = torch.empty(input_.shape, dtype=grad_input.dtype, device=grad_input.device)
            dgrad = C.reduce_scatter_tensor_async(shard, grad_input, tp, "tp_reduce_scatter")
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = dy.t().matmul(gather.wait().reshape(-1, input_.shape[-1])) if needs_wgrad else None
        grad_bias = dy.sum(dim=0) if needs_bgrad else None
        return dgrad.wait() if dgrad is not None else None, grad_weight, grad_bias, None


def _times(output: torch.Tensor, multiplier: float | None) -> torch.Tensor:
    """A linear's output times its fixed multiplier (μnit Scaling's 1/sqrt(fan_in): --unit-scaling), outside the GEMM,
    so the FP8 operands stay the unit-scale weight and input."""
    return output if multiplier is None else output * multiplier


class ColumnParallelLinear(Fp8GemmModule):
    """``Y = X Aᵀ (+ b)`` with A split along its output features: rank r holds ``A_r`` ``[out/TP, in]``.

    ============  =====================================  ============================================
    tensor        shape                                  note
    ============  =====================================  ============================================
    input         ``[s/TP, b, in]`` (SP) or ``[s, b, in]``  replicated across TP without SP
    weight        ``[out/TP, in]``                       tags: partition_dim 0, ``partition_stride``
    output        ``[s, b, out/TP]``                     ``[s, b, out]`` with ``gather_output``
    ============  =====================================  ============================================

    Backward: dgrad ``dX = dY A_r`` is a partial sum over TP ranks, hence the all-reduce (no SP) or the
    reduce-scatter back to ``[s/TP, b, in]`` (SP) in the mappings; wgrad ``dA_r = dYᵀ X`` is local.
    ``skip_weight_param_allocation`` lets the output head use the tied embedding weight passed to
    ``forward`` (same ``[vocab/TP, hidden]`` shard).
    """

    def __init__(self, input_size: int, output_size: int, parallel_state: ParallelState | LinearLayout, *,
                 bias: bool = False,
                 gather_output: bool = False, sequence_parallel: bool | None = None,
                 init_method: InitMethod | None = None, partition_stride: int = 1,
                 skip_weight_param_allocation: bool = False, padded_vocab: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 fp8_recipe: Fp8Recipe | None = None, perform_initialization: bool = True) -> None:
        super().__init__()
        self.tp = parallel_state.tp_group
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, self.tp.size, "output size of a column-parallel layer")
        self.gather_output = gather_output
        self.sequence_parallel = parallel_state.sequence_parallel if sequence_parallel is None else sequence_parallel
        if self.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output is not supported with sequence parallelism")
        init_method = init_method or init_method_normal(0.02)
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype,
                                                   device=device))
            set_tensor_model_parallel_attributes(self.weight, 0, partition_stride, padded_vocab)
            _init_weight(self.weight, init_method, self.tp, perform_initialization)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, 0, partition_stride, padded_vocab)
        else:
            self.register_parameter("bias", None)
        self.set_recipe(fp8_recipe)
        self._tp_comm = TensorParallelSequenceComm(self.tp)  # the FP8 op's collectives (async, overlapped)
        self.output_multiplier: float | None = None  # --unit-scaling: 1/sqrt(input_size), set by the model

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                prologue: InputPrologue | None = None) -> torch.Tensor:
        """`prologue`: input_ is the input of the RMSNorm in front of this layer (fused into FP8's input cast)."""
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear was built with skip_weight_param_allocation: pass `weight`")
            weight = self.weight
        output = _times(self._forward_impl(input_, weight, prologue), self.output_multiplier)
        if self.bias is not None:
            output = add_bias(output, self.bias)  # its grad goes to bias.main_grad when that exists
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp)
        return output

    def _forward_impl(self, input_: torch.Tensor, weight: torch.Tensor,
                      prologue: InputPrologue | None = None) -> torch.Tensor:
        """Entering the TP region + local GEMM. In FP8 the op does the communication itself: under SP it
        all-gathers FP8 bytes and reduce-scatters dgrad, without SP it all-reduces dgrad, overlapped with wgrad."""
        if self.sequence_parallel:
            return self.linear(input_, weight, sp_input=self._tp_comm, high_precision=self._high_precision_impl,
                               prologue=prologue)
        return self.linear(input_, weight, tp_input=self._tp_comm, high_precision=self._high_precision_impl,
                           prologue=prologue)

    def sharded_amax_sync(self):
        return self._tp_comm.sync_amax if self.tp.size > 1 else None  # current scales of shards: the whole tensor's

    def _high_precision_impl(self, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.sequence_parallel:
            if self.tp.size > 1:
                return _SequenceParallelLinear.apply(input_, weight, bias, self.tp)
        else:
            # The GEMM below is the region's only consumer: its dgrad is fresh, all-reduced in place.
            input_ = copy_to_tensor_model_parallel_region(input_, self.tp, reuse_grad=True)
        return F.linear(input_, weight, bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (local {self.output_size_per_partition}), "
                f"tp={self.tp.size}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(Fp8GemmModule):
    """``Y = X Aᵀ (+ b)`` with A split along its input features: rank r holds ``A_r`` ``[out, in/TP]``.

    ===============  ======================  =============================================================
    tensor           shape                   note
    ===============  ======================  =============================================================
    input            ``[s, b, in/TP]``       the output of a column-parallel layer (``input_is_parallel``)
    weight           ``[out, in/TP]``        tags: partition_dim 1
    partial output   ``[s, b, out]``         ``X_r A_rᵀ``; summed over TP ranks
    output           ``[s/TP, b, out]`` (SP, reduce-scatter) or ``[s, b, out]`` (all-reduce)
    ===============  ======================  =============================================================

    Backward: the reduce's dual (identity or all-gather) hands every rank the full ``dY``; dgrad
    ``dX_r = dY A_r`` and wgrad ``dA_r = dYᵀ X_r`` are local. The bias is added after the reduction,
    so it is replicated; under SP its grad covers only the local sequence chunk and is tagged
    ``sequence_parallel`` for ``allreduce_sequence_parallel_grads``.
    """

    def __init__(self, input_size: int, output_size: int, parallel_state: ParallelState | LinearLayout, *,
                 bias: bool = False,
                 input_is_parallel: bool = True, sequence_parallel: bool | None = None,
                 init_method: InitMethod | None = None, params_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, fp8_recipe: Fp8Recipe | None = None,
                 perform_initialization: bool = True) -> None:
        super().__init__()
        self.tp = parallel_state.tp_group
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, self.tp.size, "input size of a row-parallel layer")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = parallel_state.sequence_parallel if sequence_parallel is None else sequence_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence parallelism needs input_is_parallel=True")
        init_method = init_method or init_method_normal(0.02)
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype,
                                               device=device))
        set_tensor_model_parallel_attributes(self.weight, 1)
        _init_weight(self.weight, init_method, self.tp, perform_initialization)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self.set_recipe(fp8_recipe)
        self._tp_comm = TensorParallelSequenceComm(self.tp)  # the FP8 op's collectives (async, overlapped)
        self.output_multiplier: float | None = None  # --unit-scaling: 1/sqrt(input_size), set by the model

    def forward(self, input_: torch.Tensor, input_channel_scale: torch.Tensor | None = None,
                prologue: InputPrologue | None = None) -> torch.Tensor:
        """`input_channel_scale`: Smooth-SwiGLU's per-channel scales of this rank's input columns.
        `prologue`: input_ is the input of the SwiGLU in front of this layer (fused into FP8's input cast)."""
        if not self.input_is_parallel:
            if prologue is not None:
                raise ValueError("RowParallelLinear: a prologue needs input_is_parallel=True")
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tp)
        output = _times(self._forward_impl(input_, input_channel_scale, prologue), self.output_multiplier)
        if self.bias is not None:
            output = add_bias(output, self.bias)  # its grad goes to bias.main_grad when that exists
        return output

    def _forward_impl(self, input_parallel: torch.Tensor, input_channel_scale: torch.Tensor | None = None,
                      prologue: InputPrologue | None = None) -> torch.Tensor:
        """Local GEMM (FP8 when a recipe is active) and the reduction of the partial sums over TP."""
        if self.sequence_parallel:
            return self.linear(input_parallel, self.weight, input_channel_scale=input_channel_scale,
                               sp_output=self._tp_comm, high_precision=self._high_precision_sp_impl, prologue=prologue)
        partial = self.linear(input_parallel, self.weight, input_channel_scale=input_channel_scale, prologue=prologue)
        return reduce_from_tensor_model_parallel_region(partial, self.tp, reuse_input=True)  # fresh GEMM output

    def sharded_amax_sync(self):
        return self._tp_comm.sync_amax if self.tp.size > 1 else None  # current scales of shards: the whole tensor's

    def _high_precision_sp_impl(self, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return reduce_scatter_to_sequence_parallel_region(F.linear(input_, weight, bias), self.tp)

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (local {self.input_size_per_partition}), out={self.output_size}, "
                f"tp={self.tp.size}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the (padded) vocab: rank r holds rows ``[r*V/TP, (r+1)*V/TP)``.

    Each rank looks up the ids it owns and writes zeros for the rest; summing over TP completes the
    lookup. Under SP that sum is a reduce-scatter along dim 0, so pass ids as ``[s, b]`` to get
    ``[s/TP, b, hidden]``; without SP it is an all-reduce and any id shape works.
    ``num_embeddings`` must already be padded (``sharding.pad_vocab_size``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel_state: ParallelState, *,
                 init_method: InitMethod | None = None, sequence_parallel: bool | None = None,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 perform_initialization: bool = True) -> None:
        super().__init__()
        self.tp = parallel_state.tp_group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sequence_parallel = parallel_state.sequence_parallel if sequence_parallel is None else sequence_parallel
        _divide(num_embeddings, self.tp.size, "padded vocab size")
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, self.tp.rank, self.tp.size)
        self.weight = nn.Parameter(torch.empty(self.vocab_end_index - self.vocab_start_index, embedding_dim,
                                               dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, 0, padded_vocab=True)
        _init_weight(self.weight, init_method or init_method_normal(0.02), self.tp, perform_initialization)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        not_owned = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(not_owned, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(not_owned.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp)
        return reduce_from_tensor_model_parallel_region(partial, self.tp, reuse_input=True)  # fresh lookup

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.size}"


def allreduce_sequence_parallel_grads(module: nn.Module, parallel_state: ParallelState) -> None:
    """Sum over TP the grads of replicated parameters that saw only a sequence shard (norm weights,
    row-parallel biases under SP): `.grad` and `main_grad`, whichever hold gradient (see the FP8 op's
    routing); call once after the last micro-batch's backward, before the DP grad reduction. One collective
    (in fp32 when the buffers mix dtypes)."""
    tp = parallel_state.tp_group
    grads = [g for p in module.parameters() if getattr(p, "sequence_parallel", False)
             for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
    if tp.size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    C.all_reduce(flat, tp, "tp_allreduce")
    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(reduced.view_as(grad))
