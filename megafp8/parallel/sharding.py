"""How a full (TP=1) tensor maps onto TP shards: parameter tags, shard/unshard, vocab padding.

Every tensor-parallel parameter carries Megatron's tags: ``tensor_model_parallel`` (bool),
``partition_dim`` and ``partition_stride``. Stride ``s`` means the full tensor is ``s`` blocks
stacked along ``partition_dim``, each block split over TP, and rank r holds the r-th piece of every
block in order (the fused gate/up weight, stride 2, gives rank r ``[gate_r; up_r]``). Vocab-sharded
tensors are also tagged ``padded_vocab`` because their full size depends on TP (see ``pad_vocab_size``).
Checkpoint resharding and the tests use these helpers; the layers only set the tags.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Vocab size rounded up to a multiple of ``make_vocab_size_divisible_by * tp_size`` (Megatron rule).

    The multiple keeps each rank's embedding / output-head shard GEMM-friendly and equal-sized.
    """
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tp_size < 1:
        raise ValueError(f"pad_vocab_size: need positive sizes, got vocab_size={vocab_size}, "
                         f"--make-vocab-size-divisible-by={make_vocab_size_divisible_by}, tp={tp_size}")
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def vocab_range(padded_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the vocab rows owned by ``tp_rank``."""
    per_rank = padded_vocab_size // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def set_tensor_model_parallel_attributes(param: torch.Tensor, partition_dim: int, partition_stride: int = 1,
                                         padded_vocab: bool = False) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = partition_stride
    param.padded_vocab = padded_vocab


def is_tensor_model_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def shard_tensor(full: torch.Tensor, tp_size: int, tp_rank: int, dim: int, stride: int = 1) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of ``full`` (see the module docstring for ``stride``)."""
    if full.shape[dim] % (stride * tp_size):
        raise ValueError(f"shard_tensor: dim {dim} of size {full.shape[dim]} does not split into "
                         f"{stride} blocks x {tp_size} ranks")
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([block.chunk(tp_size, dim=dim)[tp_rank] for block in blocks], dim=dim).contiguous()


def unshard_tensors(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of ``shard_tensor``: the full tensor from every rank's shard, in rank order."""
    per_rank_blocks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([torch.cat([blocks[b] for blocks in per_rank_blocks], dim=dim) for b in range(stride)], dim=dim)


def resize_vocab_dim(full: torch.Tensor, padded_vocab_size: int, dim: int = 0) -> torch.Tensor:
    """Truncate or zero-pad the vocab dim: padded sizes differ between TP layouts of one model."""
    current = full.shape[dim]
    if current >= padded_vocab_size:
        return full.narrow(dim, 0, padded_vocab_size)
    pad_shape = list(full.shape)
    pad_shape[dim] = padded_vocab_size - current
    return torch.cat([full, full.new_zeros(pad_shape)], dim=dim)


def shard_state_dict(full_state_dict: Mapping[str, torch.Tensor], module: nn.Module, tp_size: int,
                     tp_rank: int) -> dict[str, torch.Tensor]:
    """Cut a TP=1 state dict into the shards ``module`` (built for ``tp_size``) expects on ``tp_rank``."""
    params = dict(module.named_parameters())
    sharded = {}
    for name, full in full_state_dict.items():
        param = params.get(name)
        if param is None or not is_tensor_model_parallel(param):
            sharded[name] = full
            continue
        if param.padded_vocab:
            full = resize_vocab_dim(full, param.shape[param.partition_dim] * tp_size, param.partition_dim)
        sharded[name] = shard_tensor(full, tp_size, tp_rank, param.partition_dim, param.partition_stride)
    return sharded


def gather_tensor_model_parallel(local: torch.Tensor, param: torch.Tensor, tp: GroupHandle,
                                 kind: str = "tp_allgather") -> torch.Tensor:
    """The full tensor (e.g. a parameter or its grad) from every TP rank's ``local`` shard of ``param``."""
    if not is_tensor_model_parallel(param) or tp.size == 1:
        return local
    dim = param.partition_dim
    gathered = C.all_gather(local.contiguous(), tp, kind, dim=dim)
    return unshard_tensors(gathered.chunk(tp.size, dim=dim), dim=dim, stride=param.partition_stride)
